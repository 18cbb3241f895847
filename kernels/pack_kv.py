"""pack_kv / unpack_kv: one layer's K/V for a request's slots <-> one contiguous transfer buffer.

The buffer holds K then V:  buffer[0] = K rows, buffer[1] = V rows, in slot order.
"""

from __future__ import annotations

import torch


def pack_kv_ref(
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
    out: torch.Tensor | None = None,  # [2, N, kv_heads, head_dim]
) -> torch.Tensor:  # [2, N, kv_heads, head_dim]
    kv_heads, head_dim = key_cache.shape[2:]
    if out is None:
        out = key_cache.new_empty((2, slots.numel(), kv_heads, head_dim))
    torch.index_select(key_cache.view(-1, kv_heads, head_dim), 0, slots, out=out[0])
    torch.index_select(value_cache.view(-1, kv_heads, head_dim), 0, slots, out=out[1])
    return out


def unpack_kv_ref(
    buffer: torch.Tensor,  # [2, N, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
) -> None:
    kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, buffer[0])
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, buffer[1])


def pack_kv_heads(
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
    heads: range,  # of the cache's kv_heads
    out: torch.Tensor | None = None,  # [2, N, len(heads), head_dim]
) -> torch.Tensor:
    """pack_kv of some heads only (a strided gather: rare enough to need no kernel)."""
    part = slice(heads.start, heads.stop)
    if out is None:
        out = key_cache.new_empty((2, slots.numel(), len(heads), key_cache.shape[3]))
    torch.index_select(key_cache.flatten(0, 1)[:, part], 0, slots, out=out[0])
    torch.index_select(value_cache.flatten(0, 1)[:, part], 0, slots, out=out[1])
    return out


def unpack_kv_heads(
    buffer: torch.Tensor,  # [2, N, len(heads), head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
    heads: range,
) -> None:
    part = slice(heads.start, heads.stop)
    key_cache.flatten(0, 1)[:, part].index_copy_(0, slots, buffer[0])
    value_cache.flatten(0, 1)[:, part].index_copy_(0, slots, buffer[1])
