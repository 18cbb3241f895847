"""store_kv: write the new tokens' K/V into the paged cache at their slots."""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,  # [N, kv_heads, head_dim]
    value: torch.Tensor,  # [N, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [N] int64, slot = block_id * block_size + offset
) -> None:
    kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)
