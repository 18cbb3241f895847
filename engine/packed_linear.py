"""CPU speed-up for bf16/fp16 linears: weights pre-packed once, at load time.

A plain bf16 `F.linear` on CPU re-lays-out the weight for the matrix unit on every call; a decode
step streams every weight once, so that doubles its memory traffic. The packings:

- oneDNN's blocked layout, used for batches of more than 16 rows (prefill chunks, large decode
  batches) and wherever neither decode kernel below applies;
- on CPUs with AMX bf16 tiles (and bf16 weights), `kernels/csrc/linear_amx.cpp`'s layout for
  batches of up to 16 rows (decode steps): one sequential, prefetched stream per 64 output
  columns, about 1.6x faster than oneDNN at 1 to 16 rows. It is bit-identical to oneDNN at those
  sizes (checked by tests/engine/test_packed_linear.py), so which path a row takes never changes
  a token;
- on CPUs with AVX-512 but no AMX, `kernels/csrc/linear_bf16.cpp`'s layout for the same
  batches: each weight read once per call, feeding all 16 rows. With AVX-512 BF16 (AMD Zen 4) a
  step's linears at 16 rows took 15.0 ms against oneDNN's 19.6 on the development VM. Without
  it (Intel Xeons before Cooper Lake) the kernel widens the bf16 values to float32 itself, as
  oneDNN does there, and is about 4x faster than oneDNN at 16 rows (a 576 x 1,536 linear: 0.27
  against 1.29 ms on a 2-core Xeon VM), because oneDNN's emulated path leaves most of the
  arithmetic units idle at that size. oneDNN's sums are blocked along K in a way that depends on
  the shape and the CPU, so a linear takes this path only when `onednn_block` finds the blocking
  that gives oneDNN's bits exactly at 2 to 16 rows (with AVX-512 BF16: blocks of 512 up to K =
  1,024, of 1,024 at K = 1,536 to 4,096; emulated: two halves of K at K = 576 and 1,536); the
  others stay on oneDNN. A single row then takes the same order as a batch, which oneDNN's own
  one-row path does not (it sums in other blocks). Emulated, oneDNN sums the same way at every
  row count, and its emulated path is as slow at prefill sizes (~40 GFLOPS on two cores at 256
  rows, against ~95 for this kernel), so there the kernel takes every batch, prefill chunks
  included, 16 rows at a time over each group of weights while it is in cache.

Keeping two copies doubles the weights' memory.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from kernels import cpu_extension

PACK_BATCH_HINT = 16  # oneDNN picks its blocking for about this many rows
AMX_MAX_ROWS = 16  # one tile of rows: amx_linear's limit
SMALL_MAX_ROWS = 16  # bf16_linear's tile: one accumulator register per row (and its limit with
# AVX-512 BF16; emulated, it takes any rows, 16 at a time)
BLOCK_CANDIDATES = (512, 1024, 256, 2048, 768)  # K values per block oneDNN might sum apart


def round_up(value: int, to: int) -> int:
    return -(-value // to) * to


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


def bf16_kernels(dtype: torch.dtype) -> ModuleType | None:
    """The C++ module when bf16 linears can run bf16_linear (AVX-512, with or without BF16) here,
    else None."""
    if dtype != torch.bfloat16:
        return None
    native = cpu_extension.load()
    return native if native is not None and native.bf16_linear_available() else None


@functools.cache
def onednn_block(native: ModuleType, n: int, k: int) -> int | None:
    """The K blocking under which bf16_linear gives oneDNN's bits for an [n, k] bf16 linear
    without bias, or None when no candidate does. Checked on a weight and inputs whose second
    half of K cancels the first (the exact result is 0 and what is left is rounding, which
    differs between summation orders far more often than on ordinary data), and on ordinary
    inputs."""
    gen = torch.Generator().manual_seed(n * 7919 + k)

    def heavy(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape, generator=gen))

    half = k // 2
    weight = torch.randn(n, k, generator=gen)
    weight[:, half : 2 * half] = -weight[:, :half]
    weight = weight.bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    cases = []
    # Not one row: oneDNN sums a single row in other blocks than 2 or more (K >= 1,536 on the
    # development VM: 512 against 1,024), so its rows depend on their batch there. Every row
    # here takes the batched order, whatever the batch.
    shapes = [(SMALL_MAX_ROWS, True), (2, True), (SMALL_MAX_ROWS, False)]
    if native.bf16_linear_max_rows() > SMALL_MAX_ROWS:  # prefill chunks too: 16-row tiles, and
        shapes += [(2 * SMALL_MAX_ROWS + 7, True), (256, True)]  # a CPU's default step budget
    for rows, cancel in shapes:
        x = heavy(rows, k)
        if cancel:
            x[:, half : 2 * half] = x[:, :half]
        x = x.bfloat16()
        cases.append((x, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")))
    ours = native.bf16_pack_weight(weight)
    # oneDNN's emulated bf16 path (no AVX-512 BF16) sums the two halves of a short K apart.
    for block in (*BLOCK_CANDIDATES, max(2, round_up(k // 2, 2))):
        if all(torch.equal(native.bf16_linear(x, ours, n, block), want) for x, want in cases):
            return block
    return None


class PackedLinear(nn.Module):
    def __init__(
        self, linear: nn.Linear, amx: ModuleType | None = None, bf16: ModuleType | None = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.data
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.bias = linear.bias.data if linear.bias is not None else None
        self.amx = amx
        self.amx_packed = amx.amx_pack_weight(weight) if amx is not None else None
        # The AMX kernel adds the bias in float32, before its one rounding to bf16.
        self.amx_bias = self.bias.float() if self.bias is not None else None
        self.bf16, self.bf16_packed, self.block, self.bf16_rows = None, None, 0, 0
        if amx is None and bf16 is not None and self.bias is None:
            block = onednn_block(bf16, self.out_features, self.in_features)
            if block is not None:
                self.bf16, self.block = bf16, block
                self.bf16_packed = bf16.bf16_pack_weight(weight)
                self.bf16_rows = bf16.bf16_linear_max_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, in_features]
        if self.amx is not None and x.shape[0] <= AMX_MAX_ROWS:
            return self.amx.amx_linear(x, self.amx_packed, self.out_features, self.amx_bias)
        if self.bf16 is not None and x.shape[0] <= self.bf16_rows:
            return self.bf16.bf16_linear(x, self.bf16_packed, self.out_features, self.block)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Replaces every nn.Linear inside `model` with a PackedLinear, in place."""
    amx = amx_kernels(dtype)
    bf16 = None if amx is not None else bf16_kernels(dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, amx, bf16))
