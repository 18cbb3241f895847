"""The ops the engine calls, bound to an implementation per device.

On CPU, decode attention, RMSNorm, rotary embedding, KV stores, SiLU-and-mul and greedy
sampling's argmax run the C++ kernels of kernels/csrc when they build here, otherwise the torch
references. On CUDA the Triton kernels of kernels/triton_*.py run (triton is imported on first
CUDA use, so CPU-only installs need none), except where torch's own kernel is the faster one:
SDPA (flash) for attention over a fresh chunk, torch for SiLU-and-mul and argmax.
TANDEM_KERNELS=reference forces the references everywhere.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from kernels import cpu_extension
from kernels.argmax import argmax_ref
from kernels.decode_attention import decode_attention_ref
from kernels.pack_kv import pack_kv_heads, pack_kv_ref, unpack_kv_heads, unpack_kv_ref
from kernels.prefill_attention import causal_attention, prefill_attention_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rotary_ref
from kernels.silu_and_mul import silu_and_mul_ref
from kernels.store_kv import store_kv_ref

__all__ = [
    "argmax",
    "causal_attention",
    "decode_attention",
    "fused_add_rms_norm",
    "pack_kv",
    "prefill_attention",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "store_kv",
    "unpack_kv",
]
NATIVE_ARGMAX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _native(x: torch.Tensor) -> ModuleType | None:
    return cpu_extension.load() if x.device.type == "cpu" else None


@functools.cache
def _references_forced() -> bool:
    return os.environ.get("TANDEM_KERNELS") == "reference"


def _triton(x: torch.Tensor, name: str) -> ModuleType | None:
    """kernels.triton_<name> for a CUDA tensor, None elsewhere or when references are forced."""
    if x.device.type != "cuda" or _references_forced():
        return None
    return importlib.import_module(f"kernels.triton_{name}")


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    gpu = _triton(query, "decode_attention")
    if gpu is not None:
        return gpu.decode_attention(
            query, key_cache, value_cache, block_tables, context_lens, scale
        )
    native = _native(query)
    if native is not None and query.shape[-1] in (32, 64, 128, 256):
        return native.decode_attention(
            query.contiguous(), key_cache, value_cache, block_tables, context_lens, scale
        )
    return decode_attention_ref(query, key_cache, value_cache, block_tables, context_lens, scale)


def prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_blocks_of_seq] int64
    context_len: int,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """A chunk after a cached prefix. (A fresh chunk goes to `causal_attention`: SDPA, whose
    flash kernel on CUDA beats reading the paged cache.)"""
    gpu = _triton(query, "prefill_attention")
    impl = gpu.prefill_attention if gpu is not None else prefill_attention_ref
    return impl(query, key_cache, value_cache, block_table, context_len, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, D] (rows may be strided), weight: [D]."""
    gpu = _triton(x, "rms_norm")
    if gpu is not None and x.stride(-1) == 1:
        return gpu.rms_norm(x, weight, eps)
    native = _native(x)
    if native is not None and x.stride(-1) == 1:
        return native.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual: [N, D], weight: [D]. One pass on
    CUDA and with the C++ kernels on CPU; elsewhere the add, then `rms_norm`."""
    gpu = _triton(x, "rms_norm")
    if gpu is not None and x.stride(-1) == 1 and residual.stride(-1) == 1:
        return gpu.fused_add_rms_norm(x, residual, weight, eps)
    native = _native(x)
    if native is not None and x.stride(-1) == 1:
        return native.add_rms_norm(x, residual, weight, eps)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim] (rows may be strided); cos, sin: [N, 1, head_dim]."""
    heads_contiguous = x.stride(2) == 1 and x.stride(1) == x.shape[2]
    gpu = _triton(x, "rotary")
    if gpu is not None and heads_contiguous:
        return gpu.rotary(x, cos, sin)
    native = _native(x)
    if native is not None and heads_contiguous:
        return native.rotary(x, cos, sin)
    return rotary_ref(x, cos, sin)


def store_kv(
    key: torch.Tensor,  # [N, kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    gpu = _triton(key, "store_kv")
    native = _native(key)
    if gpu is not None:
        gpu.store_kv(key, value, key_cache, value_cache, slot_mapping)
    elif native is not None:
        native.store_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        store_kv_ref(key, value, key_cache, value_cache, slot_mapping)


def pack_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
    out: torch.Tensor | None = None,  # [2, N, kv_heads, head_dim]
    heads: range | None = None,  # a part of the cache's heads (tensor-parallel routes)
) -> torch.Tensor:  # [2, N, kv_heads, head_dim]: K rows then V rows, in slot order
    if _is_part(heads, key_cache):
        return pack_kv_heads(key_cache, value_cache, slots, heads, out)
    gpu = _triton(key_cache, "pack_kv")
    impl = gpu.pack_kv if gpu is not None else pack_kv_ref
    return impl(key_cache, value_cache, slots, out)


def unpack_kv(
    buffer: torch.Tensor,  # [2, N, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
    heads: range | None = None,  # the cache's heads the buffer holds; all if None
) -> None:
    if _is_part(heads, key_cache):
        unpack_kv_heads(buffer, key_cache, value_cache, slots, heads)
        return
    gpu = _triton(key_cache, "pack_kv")
    if gpu is not None:
        gpu.unpack_kv(buffer, key_cache, value_cache, slots)
        return
    native = _native(buffer)
    if native is not None:  # a scatter by slot is exactly a KV store: about 4x index_copy_
        native.store_kv(buffer[0], buffer[1], key_cache, value_cache, slots)
    else:
        unpack_kv_ref(buffer, key_cache, value_cache, slots)


def _is_part(heads: range | None, cache: torch.Tensor) -> bool:
    return heads is not None and len(heads) != cache.shape[2]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [N, 2*I] -> [N, I]
    # On CUDA torch's two element-wise kernels; no Triton version yet.
    native = _native(x)
    if native is not None and x.is_contiguous():
        return native.silu_and_mul(x)
    return silu_and_mul_ref(x)


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows] int64
    """The first index of each row's maximum (NaN above everything), as `argmax(-1)` gives it,
    read in the logits' own dtype on CPU (no float32 copy of the whole batch's logits)."""
    native = _native(logits)
    if native is not None and logits.dtype in NATIVE_ARGMAX_DTYPES and logits.stride(-1) == 1:
        return native.argmax_rows(logits)
    return argmax_ref(logits)
