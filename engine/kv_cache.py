"""The paged KV cache: per layer, K and V of [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from engine.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for `block_size` tokens."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element_size


def num_blocks_for_budget(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    num_blocks = budget_bytes // bytes_per_block(cfg, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
            f"({bytes_per_block(cfg, block_size, dtype)} bytes each)"
        )
    return int(num_blocks)


def allocate_kv_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
