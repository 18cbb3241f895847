"""Triton kernels run in Triton's interpreter on machines without CUDA.

TRITON_INTERPRET must be set before a kernel is decorated (on import of kernels.triton_*), so it
is set here, at collection, before any test module imports one. Nothing else in the test suite
imports triton, and the variable means nothing to torch. On a CUDA machine the kernels compile
for the GPU and the interpreted CPU tests skip (run them there with TRITON_INTERPRET=1 set).
"""

from __future__ import annotations

import importlib.util
import os

import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
