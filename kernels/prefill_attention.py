"""Prefill attention: a chunk of query tokens over its sequence's paged cache (causal).

The chunk's own K/V are already stored, so the chunk sees `context_len` keys: the cached prefix
followed by itself. Query i (0-based in the chunk) sees keys 0 .. context_len - num_queries + i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention_ref(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_blocks_of_seq] int64
    context_len: int,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    num_queries = query.shape[0]
    kv_heads, head_dim = key_cache.shape[2:]
    keys = key_cache.index_select(0, block_table).view(-1, kv_heads, head_dim)[:context_len]
    values = value_cache.index_select(0, block_table).view(-1, kv_heads, head_dim)[:context_len]
    return causal_attention(query, keys, values, scale, prefix_len=context_len - num_queries)


def causal_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    keys: torch.Tensor,  # [L, kv_heads, head_dim], L = prefix_len + T
    values: torch.Tensor,
    scale: float,
    prefix_len: int = 0,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    k = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, L, D]
    v = values.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        rows = torch.arange(q.shape[2], device=q.device)[:, None] + prefix_len
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= rows  # [T, L]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)
