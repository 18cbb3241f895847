"""pack_kv / unpack_kv in Triton: one layer's K/V rows for a request's slots, gathered from the
paged cache into a contiguous transfer buffer [2, N, kv_heads, head_dim] (K then V), and
scattered back. One kernel serves both directions (UNPACK flips source and destination).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import require, require_cache_pair, require_index, same_device
from kernels.triton_store_kv import row_tile


@triton.jit
def _pack_kv_kernel(
    key_cache_ptr,
    value_cache_ptr,
    buffer_ptr,
    slot_ptr,
    num_tokens,
    half_stride,  # buffer[0] -> buffer[1]
    row_stride,  # buffer[:, i] -> buffer[:, i + 1]
    block_stride,
    token_stride,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    UNPACK: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_ROW)
    token_mask = tokens < num_tokens
    mask = token_mask[:, None] & (cols[None, :] < ROW)
    slots = tl.load(slot_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    paged = (slots // BLOCK_SIZE) * block_stride + (slots % BLOCK_SIZE) * token_stride
    paged = paged[:, None] + cols[None, :]
    packed = tokens.to(tl.int64)[:, None] * row_stride + cols[None, :]
    if UNPACK:
        k = tl.load(buffer_ptr + packed, mask=mask)
        tl.store(key_cache_ptr + paged, k, mask=mask)
        v = tl.load(buffer_ptr + half_stride + packed, mask=mask)
        tl.store(value_cache_ptr + paged, v, mask=mask)
    else:
        k = tl.load(key_cache_ptr + paged, mask=mask)
        tl.store(buffer_ptr + packed, k, mask=mask)
        v = tl.load(value_cache_ptr + paged, mask=mask)
        tl.store(buffer_ptr + half_stride + packed, v, mask=mask)


def _check(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, buffer: torch.Tensor
) -> None:
    require_cache_pair(key_cache, value_cache)
    require_index("slots", slots, 1)
    kv_heads, head_dim = key_cache.shape[2:]
    want = (2, slots.shape[0], kv_heads, head_dim)
    require(tuple(buffer.shape) == want, f"buffer: shape {tuple(buffer.shape)}, expected {want}")
    require(buffer.dtype == key_cache.dtype, f"buffer: dtype {buffer.dtype} vs {key_cache.dtype}")
    require(
        buffer.stride(3) == 1 and buffer.stride(2) == head_dim,
        "buffer: each token's kv_heads x head_dim row must be contiguous",
    )
    same_device(key_cache, value_cache, slots, buffer)


def _launch(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    buffer: torch.Tensor,
    slots: torch.Tensor,
    unpack: bool,
) -> None:
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    row = key_cache.shape[2] * key_cache.shape[3]
    block_t, block_row = row_tile(row)
    _pack_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key_cache, value_cache, buffer, slots,
        num_tokens, buffer.stride(0), buffer.stride(1), key_cache.stride(0), key_cache.stride(1),
        BLOCK_SIZE=key_cache.shape[1], ROW=row, BLOCK_T=block_t, BLOCK_ROW=block_row,
        UNPACK=unpack,
    )  # fmt: skip


def pack_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
    out: torch.Tensor | None = None,  # [2, N, kv_heads, head_dim]
) -> torch.Tensor:  # [2, N, kv_heads, head_dim]
    if out is None:
        out = key_cache.new_empty((2, slots.shape[0], *key_cache.shape[2:]))
    _check(key_cache, value_cache, slots, out)
    _launch(key_cache, value_cache, out, slots, unpack=False)
    return out


def unpack_kv(
    buffer: torch.Tensor,  # [2, N, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
) -> None:
    _check(key_cache, value_cache, slots, buffer)
    _launch(key_cache, value_cache, buffer, slots, unpack=True)
