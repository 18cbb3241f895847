"""Triton store_kv and pack_kv / unpack_kv against their torch references: pure copies, so the
results must be bit-identical."""

from __future__ import annotations

import pytest
import torch

from kernels.pack_kv import pack_kv_ref, unpack_kv_ref
from kernels.store_kv import store_kv_ref
from tests.support.triton_cases import (
    BLOCK_SIZES,
    HALF_DTYPES,
    MODEL_HEADS,
    compiled,
    device,
    interpreted,
    paged_cache,
    shuffled_slots,
)

SMALL = dict(num_blocks=12, block_size=4, kv_heads=2, head_dim=16)
LLAMA_8B = dict(num_blocks=1024, block_size=16, kv_heads=8, head_dim=128)


def check_store_kv(shape: dict, num_tokens: int, dtype: torch.dtype) -> None:
    from kernels.triton_store_kv import store_kv

    gen = torch.Generator().manual_seed(num_tokens)
    key_cache, value_cache = paged_cache(**shape, dtype=dtype, gen=gen)
    heads, kv_heads, head_dim = 3, shape["kv_heads"], shape["head_dim"]
    # k and v as the engine passes them: strided slices of one fused qkv row
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen)
    qkv = qkv.to(device=device(), dtype=dtype)
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = shuffled_slots(shape["num_blocks"], shape["block_size"], num_tokens, gen)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    store_kv_ref(key, value, want_k, want_v, slots)
    store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def check_pack_roundtrip(shape: dict, num_tokens: int, dtype: torch.dtype) -> None:
    from kernels.triton_pack_kv import pack_kv, unpack_kv

    gen = torch.Generator().manual_seed(num_tokens)
    key_cache, value_cache = paged_cache(**shape, dtype=dtype, gen=gen)
    slots = shuffled_slots(shape["num_blocks"], shape["block_size"], num_tokens, gen)
    packed = pack_kv(key_cache, value_cache, slots)
    assert torch.equal(packed, pack_kv_ref(key_cache, value_cache, slots))

    dest_k, dest_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    want_k, want_v = dest_k.clone(), dest_v.clone()
    dest_slots = shuffled_slots(shape["num_blocks"], shape["block_size"], num_tokens, gen)
    unpack_kv(packed, dest_k, dest_v, dest_slots)
    unpack_kv_ref(packed, want_k, want_v, dest_slots)
    assert torch.equal(dest_k, want_k) and torch.equal(dest_v, want_v)


@interpreted
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 4, 11])  # one token, one full block, a ragged tail
def test_store_kv_matches_reference(dtype: torch.dtype, num_tokens: int) -> None:
    check_store_kv(SMALL, num_tokens, dtype)


@interpreted
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 8, 13])
def test_pack_unpack_match_reference(dtype: torch.dtype, num_tokens: int) -> None:
    check_pack_roundtrip(SMALL, num_tokens, dtype)


@interpreted
def test_pack_fills_a_given_buffer_and_empty_is_a_no_op() -> None:
    from kernels.triton_pack_kv import pack_kv, unpack_kv

    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = paged_cache(**SMALL, dtype=torch.float16, gen=gen)
    slots = shuffled_slots(12, 4, 6, gen)
    out = torch.empty(2, 6, 2, 16, dtype=torch.float16)
    assert pack_kv(key_cache, value_cache, slots, out=out) is out
    assert torch.equal(out, pack_kv_ref(key_cache, value_cache, slots))
    none = torch.empty(0, dtype=torch.int64)
    assert pack_kv(key_cache, value_cache, none).shape == (2, 0, 2, 16)
    before = key_cache.clone()
    unpack_kv(torch.empty(2, 0, 2, 16, dtype=torch.float16), key_cache, value_cache, none)
    assert torch.equal(key_cache, before)


@interpreted
def test_launchers_reject_bad_arguments() -> None:
    from kernels.triton_pack_kv import pack_kv
    from kernels.triton_store_kv import store_kv

    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = paged_cache(**SMALL, dtype=torch.float16, gen=gen)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), key_cache, value_cache, slots)
    with pytest.raises(ValueError, match="shape"):
        pack_kv(key_cache, value_cache, slots, out=torch.empty(2, 4, 2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="integer"):
        pack_kv(key_cache, value_cache, slots.float())
    with pytest.raises(ValueError, match="strides"):
        pack_kv(key_cache, value_cache.transpose(0, 1).contiguous().transpose(0, 1), slots)


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 777, 8192])
def test_gpu_copies_match_reference(dtype: torch.dtype, num_tokens: int) -> None:
    check_store_kv(LLAMA_8B, min(num_tokens, 4096), dtype)
    check_pack_roundtrip(LLAMA_8B, num_tokens, dtype)


def model_cache(model: str, block_size: int, num_blocks: int) -> dict:
    _, kv_heads, head_dim = MODEL_HEADS[model]
    return dict(num_blocks=num_blocks, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)


@interpreted
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("model", MODEL_HEADS)
def test_model_shapes_match_reference(model: str, block_size: int) -> None:
    shape = model_cache(model, block_size, num_blocks=6)
    check_store_kv(shape, 37, torch.bfloat16)
    check_pack_roundtrip(shape, 37, torch.bfloat16)


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("model", MODEL_HEADS)
@pytest.mark.parametrize("num_tokens", [1, 777, 4096])
def test_gpu_model_shapes_match_reference(model: str, block_size: int, num_tokens: int) -> None:
    shape = model_cache(model, block_size, num_blocks=512)
    check_store_kv(shape, num_tokens, torch.bfloat16)
    check_pack_roundtrip(shape, num_tokens, torch.bfloat16)
