"""Shared helpers of the Triton kernel tests: skip marks and small paged caches."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Interpreted on CPU tensors (TRITON_INTERPRET=1, small shapes).
interpreted = pytest.mark.skipif(
    not (HAVE_TRITON and INTERPRETED), reason="needs triton with TRITON_INTERPRET=1"
)
# Compiled for a GPU, real shapes (mark those tests `gpu` as well).
compiled = pytest.mark.skipif(
    not (HAVE_TRITON and torch.cuda.is_available() and not INTERPRETED),
    reason="needs CUDA and triton (not interpreted)",
)
HALF_DTYPES = [torch.float16, torch.bfloat16]
# (query heads, KV heads, head dim) of the models GPU runs serve, and the cache block sizes
# they are served with: every kernel is checked at each pair.
MODEL_HEADS = {
    "smollm2-135m": (9, 3, 64),
    "llama-3.2-1b": (32, 8, 64),
    "llama-3.1-8b": (32, 8, 128),
}
BLOCK_SIZES = [16, 32]


def device() -> str:
    return "cpu" if INTERPRETED else "cuda"


def paged_cache(
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(device=device(), dtype=dtype)
    value_cache = torch.randn(shape, generator=gen).to(device=device(), dtype=dtype)
    return key_cache, value_cache


def shuffled_slots(
    num_blocks: int, block_size: int, count: int, gen: torch.Generator
) -> torch.Tensor:  # [count] int64: distinct slots in shuffled, non-contiguous blocks
    blocks = torch.randperm(num_blocks, generator=gen)[: -(-count // block_size)]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:count]
    return slots.to(device())
