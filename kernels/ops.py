"""The ops the engine calls, bound to an implementation per device.

Today every device uses the torch references; Triton versions plug in here behind the same
signatures.
"""

from __future__ import annotations

from kernels.decode_attention import decode_attention_ref as decode_attention
from kernels.prefill_attention import causal_attention
from kernels.prefill_attention import prefill_attention_ref as prefill_attention
from kernels.store_kv import store_kv_ref as store_kv

__all__ = ["causal_attention", "decode_attention", "prefill_attention", "store_kv"]
