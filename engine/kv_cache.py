"""The paged KV cache: per layer, K and V of [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.parallel import TPShard, single


def bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, shard: TPShard | None = None
) -> int:
    """K and V of every layer for `block_size` tokens, of the KV heads `shard` holds."""
    kv_heads = (shard or single(cfg)).num_kv_heads
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * kv_heads * cfg.head_dim * element_size


def num_blocks_for_budget(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    budget_bytes: int,
    shard: TPShard | None = None,
) -> int:
    """Blocks that fit `budget_bytes` on each rank."""
    per_block = bytes_per_block(cfg, block_size, dtype, shard)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
            f"({per_block} bytes each)"
        )
    return int(num_blocks)


def allocate_kv_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: TPShard | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num_blocks` blocks and one more, block `num_blocks`, that no sequence is given: the
    padding rows of a captured decode step write there (engine/cuda_graphs.py)."""
    shape = (num_blocks + 1, block_size, (shard or single(cfg)).num_kv_heads, cfg.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
