"""Prefill attention in Triton over the paged cache, for a chunk that follows a cached prefix.

The chunk's T queries sit at the end of the sequence's `context_len` tokens, whose K/V (prefix
and chunk alike) are already in the cache. Query i sees keys 0 .. prefix_len + i:

    keys     0 ............ prefix_len ........ context_len
    query 0  |##############|#
    query 1  |##############|##
    query T-1|##############|#################|

One program owns BLOCK_M queries of one head and runs an online softmax over key tiles read in
place through the block table, stopping at its last query's causal bound. Query heads that
share a KV head are launched next to each other, so their K/V tiles are read from L2.

A chunk with no cached prefix never comes here: `ops.causal_attention` hands it to torch's SDPA,
whose flash kernel is faster on contiguous fresh K/V than a paged read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    dot_dtype,
    dot_precision,
    require,
    require_cache_pair,
    require_float,
    require_index,
    same_device,
)

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    out_ptr,
    num_queries,
    context_len,
    scale_log2,  # softmax scale * log2(e): the kernel works in powers of two
    query_stride_t,
    query_stride_h,
    block_stride,
    token_stride,
    out_stride_t,
    out_stride_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    kv_head = head // GROUP
    prefix_len = context_len - num_queries
    queries = first + tl.arange(0, BLOCK_M)
    query_mask = queries < num_queries
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_offsets = queries[:, None] * query_stride_t + head * query_stride_h + dims[None, :]
    q_mask = query_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, D]

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 domain
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last_key = tl.minimum(context_len, prefix_len + first + BLOCK_M)  # exclusive
    for tile in range(0, last_key, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        key_mask = keys < context_len
        block_ids = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0)
        rows_at = block_ids.to(tl.int64) * block_stride + (keys % BLOCK_SIZE) * token_stride
        kv_offsets = rows_at[:, None] + kv_head * HEAD_DIM + dims[None, :]
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, N]
        visible = key_mask[None, :] & (keys[None, :] <= prefix_len + queries[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    out_offsets = queries[:, None] * out_stride_t + head * out_stride_h + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_blocks_of_seq]
    context_len: int,  # prefix + T: the chunk's own K/V are already stored
    scale: float,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    require_cache_pair(key_cache, value_cache)
    require(query.dim() == 3, f"query: [T, heads, head_dim] expected, got {tuple(query.shape)}")
    require(query.stride(2) == 1, "query: head_dim must be contiguous")
    require_float("query", query, key_cache.dtype)
    num_queries, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    require(head_dim == key_cache.shape[3], f"query head_dim {head_dim} vs cache")
    require(num_heads % kv_heads == 0, "query heads must be a multiple of KV heads")
    require_index("block_table", block_table, 1)
    require(
        num_queries <= context_len <= block_table.shape[0] * block_size,
        f"context_len {context_len} must cover the {num_queries} queries and fit the block table",
    )
    same_device(query, key_cache, value_cache, block_table)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_queries == 0:
        return out
    grid = (num_heads, triton.cdiv(num_queries, block_m))  # heads of one KV head side by side
    _prefill_attention_kernel[grid](
        query, key_cache, value_cache, block_table, out,
        num_queries, context_len, scale * LOG2E,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, DOT_DTYPE=dot_dtype(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
