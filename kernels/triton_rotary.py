"""Rotary embedding in Triton (rotate-half layout), one token's heads per program.

Same roundings as the reference `x * cos + rotate_half(x) * sin`: each product is rounded to the
output dtype, then their sum. One pass replaces torch's five (two slices, cat, two multiplies, add).
Compiled without fused multiply-adds: with them, the compiler folded one product's rounding into
an FMA and fp16 results were a unit off torch's in 1.5% of values (an H200, 2026-11-27); without
them, fp16 and bf16 match torch bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import require, require_float, require_rows, same_device


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_stride,
    cos_stride,
    sin_stride,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    mask = (heads[:, None] < HEADS) & col_mask[None, :]
    offsets = heads[:, None] * (2 * HALF) + cols[None, :]  # first halves of each head
    x_row = x_ptr + token * x_stride + offsets
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    cos_row = cos_ptr + token * cos_stride + cols
    sin_row = sin_ptr + token * sin_stride + cols
    cos1 = tl.load(cos_row, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    out1 = (x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    out_row = out_ptr + token * (HEADS * 2 * HALF) + offsets
    tl.store(out_row, out1.to(dtype), mask=mask)
    tl.store(out_row + HALF, out2.to(dtype), mask=mask)


def rotary(
    x: torch.Tensor,  # [N, heads, head_dim], rows may be strided
    cos: torch.Tensor,  # [N, 1, head_dim]
    sin: torch.Tensor,  # [N, 1, head_dim]
) -> torch.Tensor:  # [N, heads, head_dim], contiguous
    require_rows("x", x)
    tokens, heads, head_dim = x.shape
    require(head_dim % 2 == 0, f"head_dim {head_dim} must be even")
    for name, t in (("cos", cos), ("sin", sin)):
        require(t.shape == (tokens, 1, head_dim), f"{name}: shape {tuple(t.shape)}")
        require(t.stride(2) == 1, f"{name}: last dimension must be contiguous")
        require_float(name, t, cos.dtype)
    require_float("x", x)
    same_device(x, cos, sin)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if tokens == 0:
        return out
    _rotary_kernel[(tokens,)](
        x, cos, sin, out, x.stride(0), cos.stride(0), sin.stride(0),
        HEADS=heads, HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
