"""C++ CPU RMSNorm and rotary embedding against their torch references."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
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
