"""What every Triton launcher shares: argument checks, the dot operand dtype, the SM count.

Triton's interpreter (TRITON_INTERPRET=1, used by the CPU tests) stores bfloat16 as raw uint16
bits: arithmetic, reductions and `tl.dot` on bfloat16 values compute on the bit patterns. The
kernels therefore widen every loaded value to float32 before any arithmetic, and the attention
kernels feed `tl.dot` float32 operands when interpreted (`dot_dtype`); compiled for a GPU they
keep the cache's 16-bit dtype so the dots run on tensor cores. The interpreter also truncates on
float32 -> bfloat16 casts where the GPU rounds to nearest even, so interpreted bfloat16 results
may sit one unit in the last place from the GPU's.
"""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype attention kernels load K/V and the query as before `tl.dot`."""
    return tl.float32 if interpreting() else _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision: exact for float32 operands (no TF32 rounding of a float32
    cache), the default otherwise (it only applies to float32 operands)."""
    return "ieee" if dot_dtype(dtype) == tl.float32 else "tf32"


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def require_float(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    require(t.dtype in FLOAT_DTYPES, f"{name}: unsupported dtype {t.dtype}")
    require(dtype is None or t.dtype == dtype, f"{name}: dtype {t.dtype}, expected {dtype}")


def require_index(name: str, t: torch.Tensor, dim: int) -> None:
    require(t.dtype in (torch.int32, torch.int64), f"{name}: integer ids expected, got {t.dtype}")
    require(t.dim() == dim, f"{name}: {dim}-d expected, got shape {tuple(t.shape)}")
    require(t.stride(-1) == 1 or t.shape[-1] <= 1, f"{name}: last dimension must be contiguous")


def require_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Paged caches [num_blocks, block_size, kv_heads, head_dim] with rows of kv_heads * head_dim
    contiguous elements, K and V alike (the kernels address both with K's strides)."""
    require(key_cache.dim() == 4, f"key_cache: 4-d expected, got {tuple(key_cache.shape)}")
    require(key_cache.shape == value_cache.shape, "key_cache and value_cache differ in shape")
    require(
        key_cache.stride() == value_cache.stride(), "key_cache and value_cache differ in strides"
    )
    require(key_cache.dtype == value_cache.dtype, "key_cache and value_cache differ in dtype")
    require_float("key_cache", key_cache)
    head_dim = key_cache.shape[3]
    require(
        key_cache.stride(3) == 1 and key_cache.stride(2) == head_dim,
        "cache: each token's kv_heads x head_dim row must be contiguous",
    )


def require_rows(name: str, t: torch.Tensor, dim: int = 3) -> None:
    """A [N, heads, head_dim] tensor whose rows may be strided but whose heads x head_dim block
    is contiguous (a slice of the fused qkv projection is)."""
    require(t.dim() == dim, f"{name}: {dim}-d expected, got shape {tuple(t.shape)}")
    require(t.stride(-1) == 1, f"{name}: last dimension must be contiguous")
    if dim == 3:
        require(t.stride(1) == t.shape[2] or t.shape[1] == 1, f"{name}: heads must be contiguous")


def same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    require(len(devices) == 1, f"tensors on different devices: {sorted(map(str, devices))}")


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the interpreter's CPU tensors."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
