"""store_kv in Triton: each new token's K and V rows copied to its slot of the paged cache.

A token's kv_heads x head_dim values are one contiguous row both in the (possibly strided) key
and value inputs and in the cache, so each program copies a tile of BLOCK_T whole rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    require,
    require_cache_pair,
    require_index,
    require_rows,
    same_device,
)

TILE_ELEMENTS = 4096  # elements one program moves per tensor; rows of Llama-3-8B are 1024


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_tokens,
    key_stride,
    value_stride,
    block_stride,
    token_stride,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_ROW)
    token_mask = tokens < num_tokens
    mask = token_mask[:, None] & (cols[None, :] < ROW)
    slots = tl.load(slot_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    paged = (slots // BLOCK_SIZE) * block_stride + (slots % BLOCK_SIZE) * token_stride
    paged = paged[:, None] + cols[None, :]
    rows = tokens.to(tl.int64)[:, None]
    k = tl.load(key_ptr + rows * key_stride + cols[None, :], mask=mask)
    tl.store(key_cache_ptr + paged, k, mask=mask)
    v = tl.load(value_ptr + rows * value_stride + cols[None, :], mask=mask)
    tl.store(value_cache_ptr + paged, v, mask=mask)


def row_tile(row: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_ROW): rows per program and the padded row width, both powers of two."""
    block_row = triton.next_power_of_2(row)
    return max(1, TILE_ELEMENTS // block_row), block_row


def store_kv(
    key: torch.Tensor,  # [N, kv_heads, head_dim], rows may be strided
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int64, slot = block_id * block_size + offset
) -> None:
    require_cache_pair(key_cache, value_cache)
    for name, t in (("key", key), ("value", value)):
        require_rows(name, t)
        require(t.shape[1:] == key_cache.shape[2:], f"{name}: shape {tuple(t.shape)} vs cache")
        require(t.dtype == key_cache.dtype, f"{name}: dtype {t.dtype} vs cache {key_cache.dtype}")
    require_index("slot_mapping", slot_mapping, 1)
    num_tokens = key.shape[0]
    require(value.shape[0] == num_tokens == slot_mapping.shape[0], "token counts differ")
    same_device(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    row = key_cache.shape[2] * key_cache.shape[3]
    block_t, block_row = row_tile(row)
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, key_cache, value_cache, slot_mapping,
        num_tokens, key.stride(0), value.stride(0), key_cache.stride(0), key_cache.stride(1),
        BLOCK_SIZE=key_cache.shape[1], ROW=row, BLOCK_T=block_t, BLOCK_ROW=block_row,
    )  # fmt: skip
