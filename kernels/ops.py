"""The ops the engine calls, bound to an implementation per device.

On CPU, decode attention, RMSNorm, rotary embedding, KV stores and SiLU-and-mul run the C++
kernels of kernels/csrc when they build here, otherwise the torch references; Triton versions
for CUDA plug in behind the same signatures. TANDEM_KERNELS=reference forces the references.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels import cpu_extension
from kernels.decode_attention import decode_attention_ref
from kernels.pack_kv import pack_kv_ref as pack_kv
from kernels.pack_kv import unpack_kv_ref as unpack_kv
from kernels.prefill_attention import causal_attention
from kernels.prefill_attention import prefill_attention_ref as prefill_attention
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rotary_ref
from kernels.silu_and_mul import silu_and_mul_ref
from kernels.store_kv import store_kv_ref

__all__ = [
    "causal_attention",
    "decode_attention",
    "pack_kv",
    "prefill_attention",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "store_kv",
    "unpack_kv",
]


def _native(x: torch.Tensor) -> ModuleType | None:
    return cpu_extension.load() if x.device.type == "cpu" else None


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    native = _native(query)
    if native is not None and query.shape[-1] in (32, 64, 128, 256):
        return native.decode_attention(
            query.contiguous(), key_cache, value_cache, block_tables, context_lens, scale
        )
    return decode_attention_ref(query, key_cache, value_cache, block_tables, context_lens, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, D] (rows may be strided), weight: [D]."""
    native = _native(x)
    if native is not None and x.stride(-1) == 1:
        return native.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim] (rows may be strided); cos, sin: [N, 1, head_dim]."""
    native = _native(x)
    if native is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return native.rotary(x, cos, sin)
    return rotary_ref(x, cos, sin)


def store_kv(
    key: torch.Tensor,  # [N, kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    native = _native(key)
    if native is not None:
        native.store_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        store_kv_ref(key, value, key_cache, value_cache, slot_mapping)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [N, 2*I] -> [N, I]
    native = _native(x)
    if native is not None and x.is_contiguous():
        return native.silu_and_mul(x)
    return silu_and_mul_ref(x)
