"""Paged decode attention in Triton: one query token per sequence over its block table.

One program owns one (sequence, KV head, context split): it loads the `group` query heads that
share the KV head as the rows of one tile (padded to 16, the smallest `tl.dot`), so each K/V tile
is read from the cache once for the whole group, and runs an online softmax over its share of the
context, BLOCK_N tokens at a time, gathering each token's row through the block table.

Long contexts with few sequences leave most of the GPU idle, so the context is split: each split
writes its normalised partial output and log-sum-exp, and a second small kernel in this file
merges the splits of each (sequence, head) (the same op, so the same file):

    context  |----- split 0 -----|----- split 1 -----|-- split 2 --|
    partial     out_0, lse_0        out_1, lse_1        out_2, lse_2
    merged   sum_s exp(lse_s - max) * out_s / sum_s exp(lse_s - max)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    dot_dtype,
    dot_precision,
    num_sms,
    require,
    require_cache_pair,
    require_float,
    require_index,
    same_device,
)

LOG2E = 1.4426950408889634
BLOCK_N = 64  # context tokens per inner step on a GPU
MIN_SPLIT_TOKENS = 512  # a split shorter than this costs more to merge than it saves
PROGRAMS_PER_SM = 2


@triton.jit
def _decode_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,  # [B, H, D] when unsplit, else partial outputs [B, H, splits, D] float32
    lse_ptr,  # [B, H, splits] float32 (log2 domain), unused when unsplit
    scale_log2,  # softmax scale * log2(e): the kernel works in powers of two
    query_stride_b,
    query_stride_h,
    block_stride,
    token_stride,
    table_stride,
    out_stride_b,
    out_stride_h,
    out_stride_s,
    lse_stride_b,
    lse_stride_h,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = split * SPLIT_TOKENS
    end = tl.minimum(context_len, start + SPLIT_TOKENS)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_offsets = seq * query_stride_b + heads[:, None] * query_stride_h + dims[None, :]
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0).to(DOT_DTYPE)  # [GROUP_PAD, D]

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max, log2 domain
    denom = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * table_stride
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        block_ids = tl.load(table + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        rows_at = block_ids * block_stride + (tokens % BLOCK_SIZE) * token_stride
        kv_offsets = rows_at[:, None] + kv_head * HEAD_DIM + dims[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = (
            tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        )  # [GROUP_PAD, N]
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # an empty split stays zero
    out_offsets = seq * out_stride_b + heads[:, None] * out_stride_h + dims[None, :]
    if SPLIT:
        out_offsets += split * out_stride_s
        tl.store(out_ptr + out_offsets, out, mask=q_mask)
        lse = tl.where(denom > 0, m + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
        lse_offsets = seq * lse_stride_b + heads * lse_stride_h + split
        tl.store(lse_ptr + lse_offsets, lse, mask=row_mask)
    else:
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # [B, H, splits, D] float32
    lse_ptr,  # [B, H, splits] float32, log2 domain
    out_ptr,  # [B, H, D]
    num_splits,
    partial_stride_b,
    partial_stride_h,
    lse_stride_b,
    lse_stride_h,
    out_stride_b,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    lse = tl.load(
        lse_ptr + seq * lse_stride_b + head * lse_stride_h + splits,
        mask=split_mask,
        other=float("-inf"),
    )
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no token at all: every weight is zero
    weights = tl.exp2(lse - top)  # [BLOCK_S]
    offsets = seq * partial_stride_b + head * partial_stride_h
    offsets += splits[:, None] * HEAD_DIM + dims[None, :]
    mask = split_mask[:, None] & (dims[None, :] < HEAD_DIM)
    partial = tl.load(partial_ptr + offsets, mask=mask, other=0.0)
    total = tl.sum(weights, axis=0)
    merged = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    out_offsets = seq * out_stride_b + head * out_stride_h + dims
    tl.store(out_ptr + out_offsets, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def split_tokens_for(
    batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device
) -> int:
    """Context tokens per split: enough splits to give every SM PROGRAMS_PER_SM programs, none
    shorter than MIN_SPLIT_TOKENS. Decided from the block table's width, not the actual lengths,
    so the launch never waits on the GPU to read context_lens."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), batch * kv_heads)
    splits = max(1, min(wanted, max_tokens // MIN_SPLIT_TOKENS))
    return triton.cdiv(triton.cdiv(max_tokens, splits), block_n) * block_n


def _check(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    require_cache_pair(key_cache, value_cache)
    require(query.dim() == 3, f"query: [B, heads, head_dim] expected, got {tuple(query.shape)}")
    require(query.stride(2) == 1, "query: head_dim must be contiguous")
    require_float("query", query, key_cache.dtype)
    kv_heads, head_dim = key_cache.shape[2:]
    require(query.shape[2] == head_dim, f"query head_dim {query.shape[2]} vs cache {head_dim}")
    require(query.shape[1] % kv_heads == 0, "query heads must be a multiple of KV heads")
    require_index("block_tables", block_tables, 2)
    require_index("context_lens", context_lens, 1)
    batch = query.shape[0]
    require(block_tables.shape[0] == batch == context_lens.shape[0], "batch sizes differ")
    same_device(query, key_cache, value_cache, block_tables, context_lens)


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]; unused tail entries may hold any id
    context_lens: torch.Tensor,  # [B], tokens each query attends to (itself included), >= 1
    scale: float,
    split_tokens: int | None = None,  # context tokens per split; None: chosen for the device
    block_n: int = BLOCK_N,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    _check(query, key_cache, value_cache, block_tables, context_lens)
    batch, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    max_tokens = block_tables.shape[1] * block_size
    if split_tokens is None:
        split_tokens = split_tokens_for(batch, kv_heads, max_tokens, block_n, query.device)
    require(split_tokens % block_n == 0, f"split_tokens must be a multiple of {block_n}")
    num_splits = max(1, triton.cdiv(max_tokens, split_tokens))
    group = num_heads // kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if num_splits == 1:
        partial, lse = out, out  # the kernel writes the final output directly
        partial_strides = (out.stride(0), out.stride(1), 0)
    else:
        partial = query.new_empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32)
        lse = query.new_empty((batch, num_heads, num_splits), dtype=torch.float32)
        partial_strides = partial.stride()[:3]
    _decode_attention_kernel[(batch, kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, context_lens, partial, lse,
        scale * LOG2E, query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), block_tables.stride(0),
        *partial_strides, lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT_TOKENS=split_tokens, SPLIT=num_splits > 1, DOT_DTYPE=dot_dtype(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            partial, lse, out, num_splits,
            partial.stride(0), partial.stride(1), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out
