"""Packed CPU linears: the AMX and AVX-512 paths give the same bits as oneDNN's inner product
(the engine's path otherwise) and, except where oneDNN's own matmul differs from it, as
F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.packed_linear import (
    AMX_MAX_ROWS,
    SMALL_MAX_ROWS,
    PackedLinear,
    amx_kernels,
    bf16_kernels,
    can_pack,
    onednn_block,
)

amx = amx_kernels(torch.bfloat16)
needs_amx = pytest.mark.skipif(amx is None, reason="no AMX bf16 tile unit (or no C++ build) here")
bf16 = bf16_kernels(torch.bfloat16)
needs_bf16 = pytest.mark.skipif(bf16 is None, reason="no AVX-512 (or no C++ build) here")
# SmolLM2's shapes (fused qkv, o, fused gate/up, down, a slice of the vocabulary) and ragged edges:
# N not a multiple of 16 or of 64, K not a multiple of 32.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576), (100, 70), (33, 64)]


def linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=gen))
    return layer


@needs_amx
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_is_bit_identical_to_onednn(n: int, k: int, bias: bool) -> None:
    layer = linear(n, k, bias, seed=n + k)
    packed = PackedLinear(layer, amx)
    onednn = PackedLinear(layer, None)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 5, AMX_MAX_ROWS):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        got = packed(x)
        assert got.shape == (rows, n)
        assert torch.equal(got, onednn(x))
        assert torch.equal(got, F.linear(x, layer.weight, layer.bias))


@needs_amx
def test_amx_rows_do_not_depend_on_their_batch() -> None:
    layer = linear(576, 1536, bias=False, seed=3)
    packed = PackedLinear(layer, amx)
    x = torch.randn(AMX_MAX_ROWS, 1536).bfloat16()
    together = packed(x)
    for row in range(AMX_MAX_ROWS):
        assert torch.equal(packed(x[row : row + 1]), together[row : row + 1])
    assert torch.equal(packed(x[3:9]), together[3:9])  # a middle slice is read in place
    assert torch.equal(packed(x[:, :1536].t().contiguous().t()), together)  # column-major input


@needs_amx
def test_amx_kernel_refuses_what_it_cannot_do() -> None:
    layer = linear(64, 64, bias=False, seed=4)
    packed = amx.amx_pack_weight(layer.weight.data)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        amx.amx_linear(torch.zeros(AMX_MAX_ROWS + 1, 64, dtype=torch.bfloat16), packed, 64, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        amx.amx_linear(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 128, None)


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN here")
def test_larger_batches_take_onednn_and_match_f_linear() -> None:
    layer = linear(576, 576, bias=True, seed=5)
    packed = PackedLinear(layer, amx)
    x = torch.randn(AMX_MAX_ROWS + 24, 576).bfloat16()
    assert torch.equal(packed(x), F.linear(x, layer.weight, layer.bias))


@needs_bf16
@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_linear_is_bit_identical_to_onednn_where_it_is_used(n: int, k: int) -> None:
    layer = linear(n, k, bias=False, seed=n + k)
    packed = PackedLinear(layer, None, bf16)
    # On an AMD Zen 4 VM: blocks of 512 up to K = 1,024, of 1,024 at K = 1,536; emulated on an
    # AVX-512F Xeon: K in two halves. Where oneDNN sums in an order bf16_linear does not
    # reproduce, oneDNN it is.
    assert (packed.bf16 is not None) == (onednn_block(bf16, n, k) is not None)
    onednn = PackedLinear(layer, None, None)
    gen = torch.Generator().manual_seed(1)
    for rows in (2, 5, SMALL_MAX_ROWS, SMALL_MAX_ROWS + 3, 3 * SMALL_MAX_ROWS + 5):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        got = packed(x)
        assert got.shape == (rows, n)
        assert torch.equal(got, onednn(x))
        want = F.linear(x, layer.weight)
        if bf16.bf16_linear_max_rows() == SMALL_MAX_ROWS:  # AVX-512 BF16
            assert torch.equal(got, want)
        else:  # F.linear is oneDNN's matmul, not its inner product: emulated, the two differ
            # in the last bit of an output now and then, whoever runs the rows
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
        # one row alone: the bits it gets in a batch (oneDNN's own one-row path may differ)
        assert torch.equal(packed(x[1:2]), got[1:2])


@needs_bf16
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536)])
def test_bf16_rows_do_not_depend_on_their_batch(n: int, k: int) -> None:
    layer = linear(n, k, bias=False, seed=6)
    packed = PackedLinear(layer, None, bf16)
    if amx is not None and packed.bf16 is None:  # (a Sapphire Rapids VM)
        pytest.skip(
            "with AMX, oneDNN sums in tiles whose order bf16_linear does not reproduce, so these "
            "shapes stay on oneDNN; the engine takes amx_linear there, whose rows are checked by "
            "test_amx_rows_do_not_depend_on_their_batch"
        )
    assert packed.bf16 is not None
    # emulated, a prefill-sized batch takes the kernel too, 16 rows at a time
    rows = SMALL_MAX_ROWS if packed.bf16_rows == SMALL_MAX_ROWS else 2 * SMALL_MAX_ROWS + 5
    x = torch.randn(rows, k).bfloat16()
    together = packed(x)
    for row in range(rows):
        assert torch.equal(packed(x[row : row + 1]), together[row : row + 1])
    assert torch.equal(packed(x[3:9]), together[3:9])
    assert torch.equal(packed(x.t().contiguous().t()), together)  # column-major input


@needs_bf16
def test_bf16_kernel_refuses_what_it_cannot_do() -> None:
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    packed = bf16.bf16_pack_weight(weight)
    if bf16.bf16_linear_max_rows() == SMALL_MAX_ROWS:  # with AVX-512 BF16 (emulated: any)
        with pytest.raises(RuntimeError, match="at most 16 rows"):
            rows = torch.zeros(SMALL_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
            bf16.bf16_linear(rows, packed, 64, 512)
    with pytest.raises(RuntimeError, match="does not fit"):
        bf16.bf16_linear(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 128, 512)
    with pytest.raises(RuntimeError, match="even"):
        bf16.bf16_linear(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 64, 3)
