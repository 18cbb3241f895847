"""CPU speed-up for bf16/fp16 linears: weights pre-packed once, at load time.

A plain bf16 `F.linear` on CPU re-lays-out the weight for the matrix unit on every call; a decode
step streams every weight once, so that doubles its memory traffic. Two packings:

- oneDNN's blocked layout, used for every batch where AMX is absent and for batches of more than
  16 rows (prefill chunks) where it is present;
- on CPUs with AMX bf16 tiles (and bf16 weights), `kernels/csrc/linear_amx.cpp`'s layout for
  batches of up to 16 rows (decode steps): one sequential, prefetched stream per 64 output
  columns, about 1.6x faster than oneDNN at 1 to 16 rows. It is bit-identical to oneDNN at those
  sizes (checked by tests/engine/test_packed_linear.py), so which path a row takes never changes
  a token. Keeping both copies doubles the weights' memory.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kernels import cpu_extension

PACK_BATCH_HINT = 16  # oneDNN picks its blocking for about this many rows
AMX_MAX_ROWS = 16  # one tile of rows: amx_linear's limit


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def amx_kernels(dtype: torch.dtype) -> ModuleType | None:
    """The C++ module when bf16 linears can run on AMX tiles here, else None."""
    if dtype != torch.bfloat16:
        return None
    native = cpu_extension.load()
    return native if native is not None and native.amx_available() else None


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, amx: ModuleType | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.data
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.bias = linear.bias.data if linear.bias is not None else None
        self.amx = amx
        self.amx_packed = amx.amx_pack_weight(weight) if amx is not None else None
        # The AMX kernel adds the bias in float32, before its one rounding to bf16.
        self.amx_bias = self.bias.float() if self.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, in_features]
        if self.amx is not None and x.shape[0] <= AMX_MAX_ROWS:
            return self.amx.amx_linear(x, self.amx_packed, self.out_features, self.amx_bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Replaces every nn.Linear inside `model` with a PackedLinear, in place."""
    amx = amx_kernels(dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, amx))
