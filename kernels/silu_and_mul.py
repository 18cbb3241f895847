"""SwiGLU's activation: SiLU of the first half of each row times its second half."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [N, 2*I] -> [N, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
