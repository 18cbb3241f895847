"""Triton prefill attention over the paged cache (a chunk after a cached prefix) against the
torch reference (gather + SDPA with an offset-causal mask)."""

from __future__ import annotations

import pytest
import torch

from kernels.prefill_attention import prefill_attention_ref
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


def chunk_case(
    prefix_len: int,
    num_queries: int,
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    head_dim: int = 32,
    block_size: int = 4,
    seed: int = 0,
):
    gen = torch.Generator().manual_seed(seed)
    context_len = prefix_len + num_queries
    num_blocks = -(-context_len // block_size)
    total_blocks = 2 * num_blocks + 1
    key_cache, value_cache = paged_cache(total_blocks, block_size, kv_heads, head_dim, dtype, gen)
    query = torch.randn(num_queries, heads, head_dim, generator=gen).to(device(), dtype)
    table = torch.randperm(total_blocks, generator=gen)[:num_blocks].to(device())  # shuffled
    return query, key_cache, value_cache, table, context_len


def check(case: tuple, scale: float = 0.17, **options: int) -> None:
    from kernels.triton_prefill_attention import prefill_attention

    got = prefill_attention(*case, scale, **options)
    want = prefill_attention_ref(*case, scale)
    tol = TOLERANCE[case[0].dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# (prefix_len, num_queries): no prefix, a single query after a prefix (context 5), a context
# ending exactly on a block boundary, ragged both ways, and more queries than one query tile.
CHUNKS = [(0, 6), (4, 1), (8, 8), (7, 10), (3, 37)]


@interpreted
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"prefix{c[0]}-q{c[1]}")
def test_matches_reference(dtype: torch.dtype, group: int, chunk: tuple[int, int]) -> None:
    check(chunk_case(*chunk, heads=group, kv_heads=1, dtype=dtype), block_m=16, block_n=16)


@interpreted
def test_context_of_one_token() -> None:
    check(chunk_case(0, 1, heads=4, kv_heads=2, dtype=torch.bfloat16), block_m=16, block_n=16)


@interpreted
def test_rejects_a_context_shorter_than_the_chunk() -> None:
    from kernels.triton_prefill_attention import prefill_attention

    query, key_cache, value_cache, table, context_len = chunk_case(2, 5, 2, 1, torch.float16)
    with pytest.raises(ValueError, match="context_len"):
        prefill_attention(query, key_cache, value_cache, table, 4, 0.2)
    with pytest.raises(ValueError, match="context_len"):
        prefill_attention(query, key_cache, value_cache, table, 4 * len(table) + 1, 0.2)


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("chunk", [(0, 1000), (16, 1), (512, 512), (3000, 1100)])
def test_gpu_matches_reference(dtype: torch.dtype, group: int, chunk: tuple[int, int]) -> None:
    case = chunk_case(*chunk, heads=8 * group, kv_heads=8, dtype=dtype, head_dim=128, block_size=16)
    check(case, scale=128**-0.5)


def check_model_shape(model: str, block_size: int, chunk: tuple[int, int]) -> None:
    heads, kv_heads, head_dim = MODEL_HEADS[model]
    case = chunk_case(*chunk, heads, kv_heads, torch.bfloat16, head_dim, block_size)
    check(case, scale=head_dim**-0.5)


@interpreted
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("model", MODEL_HEADS)
def test_model_shapes_match_reference(model: str, block_size: int) -> None:
    check_model_shape(model, block_size, (block_size + 3, 21))


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("model", MODEL_HEADS)
@pytest.mark.parametrize("chunk", [(0, 300), (37, 64), (1000, 129), (2048, 2048)])
def test_gpu_model_shapes_match_reference(
    model: str, block_size: int, chunk: tuple[int, int]
) -> None:
    check_model_shape(model, block_size, chunk)
