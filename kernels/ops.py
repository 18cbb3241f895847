"""The ops the engine calls, bound to an implementation per device.

On CPU, decode attention runs the C++ kernel from kernels/csrc when it builds here, otherwise the
torch reference; Triton versions for CUDA plug in behind the same signatures.
TANDEM_KERNELS=reference forces the torch references everywhere (for debugging a kernel).
"""

from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels.decode_attention import decode_attention_ref
from kernels.prefill_attention import causal_attention
from kernels.prefill_attention import prefill_attention_ref as prefill_attention
from kernels.store_kv import store_kv_ref as store_kv

__all__ = ["causal_attention", "decode_attention", "prefill_attention", "store_kv"]


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    native = cpu_extension.load() if query.device.type == "cpu" else None
    if native is not None:
        return native.decode_attention(
            query.contiguous(), key_cache, value_cache, block_tables, context_lens, scale
        )
    return decode_attention_ref(query, key_cache, value_cache, block_tables, context_lens, scale)
