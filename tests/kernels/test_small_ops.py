"""C++ CPU RMSNorm, rotary embedding, SiLU-and-mul, KV store and argmax against their references."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from kernels.argmax import argmax_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rotary_ref

native = cpu_extension.load()
pytestmark = pytest.mark.skipif(native is None, reason="C++ CPU kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    got, want = native.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # same roundings in the same order: at most one unit in the last place apart
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_rms_norm_reads_strided_rows() -> None:
    x = torch.randn(5, 64)
    wide = torch.cat([x, torch.randn(5, 32)], dim=1)  # rows of 96, only 64 used
    weight = torch.randn(64)
    assert torch.equal(
        native.rms_norm(wide[:, :64], weight, 1e-6), native.rms_norm(x, weight, 1e-6)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference_on_a_strided_slice(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 5, 32, generator=gen).to(dtype)  # 3 "query" heads + 2 others per row
    angles = torch.randn(6, 1, 32, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = native.rotary(qkv[:, :3], cos, sin)
    want = rotary_ref(qkv[:, :3], cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    from kernels.silu_and_mul import silu_and_mul_ref

    x = (torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    torch.testing.assert_close(native.silu_and_mul(x), silu_and_mul_ref(x), rtol=1e-2, atol=1e-2)


def test_store_kv_writes_exactly_the_slots() -> None:
    from kernels.store_kv import store_kv_ref

    caches = [torch.zeros(6, 4, 2, 8) for _ in range(4)]
    qkv = torch.randn(3, 5, 8)  # store from strided views, as the model does
    key, value = qkv[:, 1:3], qkv[:, 3:5]
    slots = torch.tensor([7, 0, 23])
    native.store_kv(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="slot out of range"):
        native.store_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 24]))


def test_pack_then_unpack_moves_exactly_the_slots():
    from kernels import ops

    torch.manual_seed(0)
    src_k, src_v = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    slots = torch.tensor([5, 6, 7, 8, 21, 0])  # crosses block boundaries, out of order
    buffer = ops.pack_kv(src_k, src_v, slots)
    assert buffer.shape == (2, 6, 2, 8)
    assert torch.equal(buffer[0], src_k.view(-1, 2, 8)[slots])
    dst_k, dst_v = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    dest = torch.tensor([12, 13, 14, 15, 2, 3])
    ops.unpack_kv(buffer, dst_k, dst_v, dest)
    assert torch.equal(dst_v.view(-1, 2, 8)[dest], src_v.view(-1, 2, 8)[slots])
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[dest] = False
    assert not dst_k.view(-1, 2, 8)[untouched].any()


def test_bf16_silu_and_mul_at_the_edges_of_exp() -> None:
    from kernels.silu_and_mul import silu_and_mul_ref

    # Gates far past exp's float range give -0 (torch's answer), never NaN.
    gate = torch.tensor([-1000.0, -100.0, -89.0, -5.0, 0.0, 5.0, 88.0, 1000.0])
    x = torch.cat([gate, torch.full_like(gate, 3.0)]).view(1, -1).bfloat16()
    got = native.silu_and_mul(x)
    assert not got.isnan().any()
    assert torch.equal(got, silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_add_then_the_norm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(96, generator=gen).to(dtype)
    normed, summed = native.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)  # rounded exactly as torch rounds the add
    assert torch.equal(normed, native.rms_norm(x + residual, weight, 1e-6))


def awkward_logits(dtype: torch.dtype, trial: int) -> torch.Tensor:
    """Rows full of ties, with infinities, NaNs and both zeros, in `dtype`; rows 1000 apart in
    memory (a slice of a wider tensor, as the vocabulary of a padded lm_head is)."""
    gen = torch.Generator().manual_seed(trial)
    wide = torch.randint(-3, 4, (9, 1000), generator=gen).to(dtype)
    logits = wide[:, :997]  # not a multiple of any vector width
    logits[0] = float("-inf")
    logits[1, (trial * 53) % 997] = float("inf")
    logits[2, (trial * 37) % 997] = float("nan")
    logits[2, (trial * 11) % 997] = float("nan")  # the first NaN wins
    logits[3] = -1.0
    logits[3, trial % 997] = -0.0
    logits[3, (trial * 7) % 997] = 0.0  # -0 and +0 are one maximum: the first of them wins
    logits[4] = float("-nan")
    logits[5] = torch.finfo(dtype).min  # the most negative finite value everywhere
    logits[6, -1] = 100.0  # the maximum in the last column
    return logits


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_is_torch_argmax_with_ties_infinities_nan_and_zeros(dtype) -> None:
    for trial in range(20):
        logits = awkward_logits(dtype, trial)
        assert logits.stride(0) == 1000
        expected = logits.float().argmax(dim=-1)
        assert torch.equal(native.argmax_rows(logits), expected), trial
        assert torch.equal(argmax_ref(logits), expected), trial


def test_argmax_rows_refuses_what_it_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="contiguous"):
        native.argmax_rows(torch.zeros(8, 4).t())
    with pytest.raises(RuntimeError, match="bf16, fp16 or float32"):
        native.argmax_rows(torch.zeros(2, 4, dtype=torch.float64))
