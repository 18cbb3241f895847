"""Triton RMSNorm (plain and fused with the residual add) and rotary embedding against their
torch references. fp16 and fp32 results match to the last bit or within float32 summation order.
bfloat16 ones may differ by a unit in the last place per rounding under the interpreter, whose
float32 -> bfloat16 cast truncates (see kernels/triton_common.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotary_ref
from tests.support.triton_cases import HALF_DTYPES, compiled, device, interpreted

DTYPES = [*HALF_DTYPES, torch.float32]
BF16_ULP = 2**-7
FP16_ULP = 2**-10


def assert_rounded_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:  # a unit in the last place per rounding (values below 8)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * BF16_ULP, atol=4 * BF16_ULP)
    elif got.dtype == torch.float16:
        # float32 sums in another order may flip the rounding of the normalised value, and the
        # weight multiply carries that unit (seen on an H200: 5 of 1.2M values 1.7 units apart)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * FP16_ULP, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def norm_case(rows: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(rows, dim + 24, generator=gen) * 3).to(device=device(), dtype=dtype)
    x = wide[:, :dim]  # strided rows, as a slice of a wider activation
    residual = torch.randn(rows, dim, generator=gen).to(device=device(), dtype=dtype)
    weight = torch.randn(dim, generator=gen).to(device=device(), dtype=dtype)
    return x, residual, weight


def check_rms_norm(rows: int, dim: int, dtype: torch.dtype) -> None:
    from kernels.triton_rms_norm import fused_add_rms_norm, rms_norm

    x, residual, weight = norm_case(rows, dim, dtype)
    assert_rounded_close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    got_out, got_sum = fused_add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    if dtype == torch.bfloat16:
        assert_rounded_close(got_sum, want_sum)
    else:  # one float32 add rounded once, as torch does it
        assert torch.equal(got_sum, want_sum)
    assert_rounded_close(got_out, want_out)


def check_rotary(
    tokens: int, heads: int, head_dim: int, dtype: torch.dtype, exact: bool = False
) -> None:
    from kernels.triton_rotary import rotary

    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, heads + 3, head_dim, generator=gen).to(device=device(), dtype=dtype)
    x = qkv[:, :heads]  # the query heads of a fused qkv row: strided rows
    angles = torch.randn(tokens, 1, head_dim, generator=gen) * 4
    cos = angles.cos().to(device=device(), dtype=dtype)
    sin = angles.sin().to(device=device(), dtype=dtype)
    got = rotary(x, cos, sin)
    assert got.is_contiguous()
    want = rotary_ref(x, cos, sin)
    if exact:
        assert got.dtype == want.dtype and torch.equal(got, want)
    else:
        assert_rounded_close(got, want)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 96])  # a power of two, and one that needs masking
def test_rms_norm_matches_reference(dtype: torch.dtype, dim: int) -> None:
    check_rms_norm(5, dim, dtype)


@interpreted
def test_rms_norm_promotes_like_the_reference() -> None:
    from kernels.triton_rms_norm import rms_norm

    x, _, weight = norm_case(3, 32, torch.float16)
    got = rms_norm(x, weight.float(), 1e-5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_ref(x, weight.float(), 1e-5))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [1, 3])
def test_rotary_matches_reference(dtype: torch.dtype, heads: int) -> None:
    check_rotary(4, heads, 32, dtype)


@interpreted
def test_rotary_rejects_mismatched_tables() -> None:
    from kernels.triton_rotary import rotary

    x = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="cos: shape"):
        rotary(x, torch.randn(3, 1, 16), torch.randn(3, 1, 16))


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rms_norm_and_rotary_match_reference(dtype: torch.dtype) -> None:
    check_rms_norm(300, 4096, dtype)
    # compiled without fused multiply-adds, every rounding is torch's (kernels/triton_rotary.py)
    check_rotary(300, 32, 128, dtype, exact=True)
