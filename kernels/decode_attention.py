"""Decode attention: one query token per sequence over its paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
) -> torch.Tensor:  # [B, max_blocks * block_size, kv_heads, head_dim]
    batch, max_blocks = block_tables.shape
    # index_select on a flat index runs several times faster on CPU than cache[block_tables].
    gathered = cache.index_select(0, block_tables.flatten())
    return gathered.view(batch, max_blocks * cache.shape[1], *cache.shape[2:])


def decode_attention_ref(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64; unused tail entries may hold any id
    context_lens: torch.Tensor,  # [B] int64, tokens each query attends to (itself included)
    scale: float,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    batch, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = num_heads // kv_heads
    keys = gather_blocks(key_cache, block_tables).transpose(1, 2)  # [B, kv_heads, L, D]
    values = gather_blocks(value_cache, block_tables).transpose(1, 2)
    # Grouped-query trick: the heads sharing one KV head act as `group` queries of one batch row,
    # so SDPA runs without copying K/V once per query head.
    grouped = query.view(batch, kv_heads, group, head_dim)
    positions = torch.arange(keys.shape[2], device=query.device)
    visible = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible, scale=scale)
    return out.reshape(batch, num_heads, head_dim)
