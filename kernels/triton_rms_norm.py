"""RMSNorm in Triton, one row per program, optionally fused with the residual add before it.

Same roundings as the reference: the row is normalised in float32, rounded to the input dtype,
then multiplied by the weight (one more rounding). With a residual, x + residual is rounded to
the input dtype first, as the unfused `x + residual` would be. One pass over the row replaces
torch's four (upcast, norm, downcast, weight multiply), five with the add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import require, require_float, same_device


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,
    residual_stride,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * D + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    require(x.dim() == 2, f"x: 2-d expected, got {tuple(x.shape)}")
    require(x.stride(1) == 1, "x: rows must be contiguous (row stride may be anything)")
    require(weight.shape == x.shape[1:], f"weight: shape {tuple(weight.shape)} vs x {x.shape}")
    require(weight.is_contiguous(), "weight must be contiguous")
    require_float("x", x)
    require_float("weight", weight)
    same_device(x, weight)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    rows, dim = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        residual_out if residual_out is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, eps,
        D=dim, BLOCK_D=block, ADD_RESIDUAL=residual is not None, num_warps=_num_warps(block),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,  # [N, D], rows may be strided
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:  # [N, D], dtype of weight * x
    _check(x, weight)
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [N, D], rows may be strided
    residual: torch.Tensor,  # [N, D], rows may be strided
    weight: torch.Tensor,  # [D]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # rms_norm(x + residual), x + residual
    _check(x, weight)
    require(residual.shape == x.shape, f"residual: shape {tuple(residual.shape)} vs x {x.shape}")
    require(residual.dtype == x.dtype, f"residual: dtype {residual.dtype} vs x {x.dtype}")
    require(residual.stride(1) == 1, "residual: rows must be contiguous")
    same_device(x, residual)
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, summed)
    return out, summed
