"""The C++ CPU decode attention against the torch reference, on small paged caches."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from kernels.decode_attention import decode_attention_ref

native = cpu_extension.load()
pytestmark = pytest.mark.skipif(native is None, reason="C++ CPU kernels did not build here")

BS = 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def paged_case(batch, heads, kv_heads, lens, dtype, head_dim=32, num_blocks=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BS, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    max_blocks = -(-max(lens) // BS)
    # Non-contiguous, shuffled block ids, different for every sequence.
    ids = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
    tables = ids.view(batch, max_blocks).to(torch.int64)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference(dtype: torch.dtype, group: int) -> None:
    # context 1, exactly one block, a block boundary, and ragged lengths in one batch
    lens = [1, BS, 2 * BS, 2 * BS + 1, 13]
    case = paged_case(len(lens), 2 * group, 2, lens, dtype)
    want = decode_attention_ref(*case, scale=0.17)
    got = native.decode_attention(*case, 0.17)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_unused_table_entries_are_ignored() -> None:
    query, key_cache, value_cache, tables, lens = paged_case(2, 4, 2, [3, 9], torch.float32)
    first = native.decode_attention(query, key_cache, value_cache, tables, lens, 0.2)
    tables[0, 1:] = 0  # past sequence 0's context: must not matter
    again = native.decode_attention(query, key_cache, value_cache, tables, lens, 0.2)
    assert torch.equal(first, again)


def test_rejects_mismatched_heads() -> None:
    query, key_cache, value_cache, tables, lens = paged_case(1, 3, 2, [5], torch.float32)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        native.decode_attention(query, key_cache, value_cache, tables, lens, 0.2)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_bf16_rows_do_not_depend_on_their_batch(head_dim: int) -> None:
    # Each sequence's result must not depend on what else is in the batch, or batching would
    # change tokens.
    lens = [1, 7, BS, 2 * BS + 1, 13, 30]
    case = paged_case(len(lens), 6, 2, lens, torch.bfloat16, head_dim=head_dim)
    query, key_cache, value_cache, tables, lens_t = case
    together = native.decode_attention(*case, 0.125)
    want = decode_attention_ref(*case, scale=0.125)
    torch.testing.assert_close(together.float(), want.float(), rtol=2e-2, atol=2e-2)
    for row in range(len(lens)):
        alone = native.decode_attention(
            query[row : row + 1], key_cache, value_cache, tables[row : row + 1],
            lens_t[row : row + 1], 0.125,
        )  # fmt: skip
        assert torch.equal(alone, together[row : row + 1])
