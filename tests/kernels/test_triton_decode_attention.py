"""Triton paged decode attention against the torch reference (gather + SDPA)."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention_ref
from tests.support.triton_cases import (
    BLOCK_SIZES,
    HALF_DTYPES,
    MODEL_HEADS,
    compiled,
    device,
    interpreted,
    paged_cache,
)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def paged_case(
    lens: list[int],
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    head_dim: int = 32,
    block_size: int = 4,
    seed: int = 0,
):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    key_cache, value_cache = paged_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(device(), dtype)
    # Non-contiguous, shuffled block ids, different for every sequence.
    ids = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
    tables = ids.view(len(lens), max_blocks).to(device())
    return query, key_cache, value_cache, tables, torch.tensor(lens, device=device())


def check(case: tuple, scale: float = 0.17, **options: int) -> None:
    from kernels.triton_decode_attention import decode_attention

    got = decode_attention(*case, scale, **options)
    want = decode_attention_ref(*case, scale)
    tol = TOLERANCE[case[0].dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# context 1, one full block, a block boundary, one past it, and a ragged length in one batch
EDGE_LENS = [1, 4, 8, 9, 13]


@interpreted
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference(dtype: torch.dtype, group: int) -> None:
    check(paged_case(EDGE_LENS, 2 * group, 2, dtype), block_n=16)


@interpreted
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_split_context_matches_reference(dtype: torch.dtype) -> None:
    # Splits of 16 tokens: a sequence spanning three splits, one ending exactly on a split
    # boundary, and short ones whose later splits are empty.
    case = paged_case([1, 16, 33, 47, 5], 8, 2, dtype, block_size=8)
    check(case, split_tokens=16, block_n=16)


@interpreted
def test_head_dim_that_is_not_a_power_of_two() -> None:
    check(paged_case([3, 10], 4, 1, torch.float16, head_dim=48), block_n=16)


@interpreted
def test_unused_table_entries_are_ignored() -> None:
    from kernels.triton_decode_attention import decode_attention

    query, key_cache, value_cache, tables, lens = paged_case([3, 9], 4, 2, torch.float16)
    first = decode_attention(query, key_cache, value_cache, tables, lens, 0.2, block_n=16)
    tables[0, 1:] = 0  # past sequence 0's context: must not matter
    again = decode_attention(query, key_cache, value_cache, tables, lens, 0.2, block_n=16)
    assert torch.equal(first, again)


@interpreted
def test_rejects_mismatched_arguments() -> None:
    from kernels.triton_decode_attention import decode_attention

    query, key_cache, value_cache, tables, lens = paged_case([5], 3, 2, torch.float16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(query, key_cache, value_cache, tables, lens, 0.2)
    query, key_cache, value_cache, tables, lens = paged_case([5], 4, 2, torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(query.float(), key_cache, value_cache, tables, lens, 0.2)
    with pytest.raises(ValueError, match="batch sizes"):
        decode_attention(query, key_cache, value_cache, tables, lens.repeat(2), 0.2)


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("split_tokens", [None, 512])
def test_gpu_matches_reference(dtype: torch.dtype, group: int, split_tokens: int | None) -> None:
    # Llama-3-8B-like heads (head_dim 128) and cache blocks of 16, long and short contexts.
    lens = [1, 16, 17, 511, 2048, 4100, 8192]
    case = paged_case(lens, 8 * group, 8, dtype, head_dim=128, block_size=16)
    check(case, scale=128**-0.5, split_tokens=split_tokens)


def check_model_shape(model: str, block_size: int, lens: list[int]) -> None:
    heads, kv_heads, head_dim = MODEL_HEADS[model]
    case = paged_case(lens, heads, kv_heads, torch.bfloat16, head_dim, block_size)
    check(case, scale=head_dim**-0.5)


@interpreted
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("model", MODEL_HEADS)
def test_model_shapes_match_reference(model: str, block_size: int) -> None:
    check_model_shape(model, block_size, [1, block_size, block_size + 1, 45])


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("model", MODEL_HEADS)
def test_gpu_model_shapes_match_reference(model: str, block_size: int) -> None:
    # a ragged batch: one token, block edges, a long context that the kernel splits
    check_model_shape(model, block_size, [1, 15, 16, 17, 33, 1000, 2049, 6000])
