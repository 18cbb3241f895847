"""Triton kernels against their torch alternatives at Llama-3-8B shapes, on a CUDA GPU.

    python benchmarks/kernels.py [--quick] [--dtype bfloat16] [--json kernels.json]

Llama-3-8B per layer: 32 query heads, 8 KV heads, head dim 128, hidden 4096, cache blocks of 16
tokens placed in shuffled (non-contiguous) blocks. Each case is timed with CUDA events by
`triton.testing.do_bench` (median, L2 flushed before every run). Achieved bandwidth is the
bytes a kernel must move (read + write, nothing counted twice) over its time, reported as a
percentage of the device's measured copy bandwidth (a large device-to-device copy), the most
a memory-bound kernel can reach. Targets: paged decode attention >= 70% at batch >= 32 and
context >= 2K; pack/unpack >= 80%. Prefill attention over a whole prompt is also timed against
SDPA's flash backend, in TFLOP/s (>= 0.8x asked).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, BLOCK = 32, 8, 128, 4096, 16
CONTEXTS = [512, 2048, 8192]
BATCHES = [1, 8, 32, 64, 256]
TOKENS = [1, 64, 512, 4096]  # rows for the element-wise ops: decode batches and prefill chunks
PREFILL_CHUNK = 512
CACHE_BYTES_LIMIT = 24 << 30  # skip cases whose K+V caches alone exceed this


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of one call."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def paged(num_tokens_per_seq: list[int], dtype: torch.dtype):
    """K/V caches holding these sequences in shuffled blocks, and their block tables."""
    blocks_per_seq = [-(-n // BLOCK) for n in num_tokens_per_seq]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    value_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    ids = torch.randperm(num_blocks, device=DEVICE)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(blocks_per_seq), width, dtype=torch.int64, device=DEVICE)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = ids[start : start + count]
        start += count
    return key_cache, value_cache, tables


def compare(
    kernel: str,
    shape: str,
    nbytes: int | None,
    ours: Callable[..., object],
    theirs: Callable[..., object],
    *args: object,
) -> dict:
    """One table row: the Triton kernel `ours` and the torch alternative on the same args."""
    triton_ms, torch_ms = bench(lambda: ours(*args)), bench(lambda: theirs(*args))
    return {
        "kernel": kernel,
        "shape": shape,
        "bytes": nbytes,
        "triton_ms": triton_ms,
        "torch_ms": torch_ms,
        "speedup": torch_ms / triton_ms,
    }


def kv_row_bytes(dtype: torch.dtype) -> int:
    return KV_HEADS * HEAD_DIM * dtype.itemsize


def decode_cases(dtype: torch.dtype, quick: bool) -> Iterator[dict]:
    from kernels.decode_attention import decode_attention_ref
    from kernels.triton_decode_attention import decode_attention

    for context in CONTEXTS[::2] if quick else CONTEXTS:
        for batch in BATCHES[::2] if quick else BATCHES:
            if 2 * batch * context * kv_row_bytes(dtype) > CACHE_BYTES_LIMIT:
                continue
            key_cache, value_cache, tables = paged([context] * batch, dtype)
            lens = torch.full((batch,), context, dtype=torch.int64, device=DEVICE)
            query = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
            args = (query, key_cache, value_cache, tables, lens, HEAD_DIM**-0.5)
            nbytes = 2 * batch * context * kv_row_bytes(dtype) + 2 * query.nbytes
            yield compare(
                "decode_attention", f"batch {batch} context {context}", nbytes,
                decode_attention, decode_attention_ref, *args,  # gather + SDPA
            )  # fmt: skip
            del key_cache, value_cache, args


def prefill_cases(dtype: torch.dtype, quick: bool) -> Iterator[dict]:
    from kernels.prefill_attention import prefill_attention_ref
    from kernels.triton_prefill_attention import prefill_attention

    for context in CONTEXTS[::2] if quick else CONTEXTS:
        chunk = min(PREFILL_CHUNK, context)
        key_cache, value_cache, tables = paged([context], dtype)
        query = torch.randn(chunk, HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
        args = (query, key_cache, value_cache, tables[0], context, HEAD_DIM**-0.5)
        yield compare(
            "prefill_attention", f"{chunk} queries after {context - chunk} cached", None,
            prefill_attention, prefill_attention_ref, *args,  # gather + masked SDPA
        )  # fmt: skip


def flash_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal attention by SDPA's flash backend, grouped-query heads as they are (no copies)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, enable_gqa=True
        )


def flash_cases(dtype: torch.dtype, quick: bool) -> Iterator[dict]:
    """A whole prompt attending to itself: our paged kernel against SDPA's flash backend on
    contiguous K/V, in TFLOP/s (2 S^2 H D: the two products, halved by the causal mask)."""
    from kernels.triton_prefill_attention import prefill_attention

    for tokens in CONTEXTS[::2] if quick else CONTEXTS:
        key_cache, value_cache, tables = paged([tokens], dtype)
        query = torch.randn(tokens, HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
        q4 = query.transpose(0, 1)[None]  # [1, H, S, D]
        k4 = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, dtype=dtype, device=DEVICE)
        v4 = torch.randn_like(k4)
        ours = partial(
            prefill_attention, query, key_cache, value_cache, tables[0], tokens, HEAD_DIM**-0.5
        )
        row = compare("prefill_vs_flash", f"{tokens} tokens, causal", None,
                      ours, partial(flash_sdpa, q4, k4, v4))  # fmt: skip
        flops = 2 * tokens * tokens * HEADS * HEAD_DIM
        row["triton_tflops"] = flops / (row["triton_ms"] * 1e-3) / 1e12
        row["torch_tflops"] = flops / (row["torch_ms"] * 1e-3) / 1e12
        yield row


def copy_cases(dtype: torch.dtype, quick: bool) -> Iterator[dict]:
    from kernels.pack_kv import pack_kv_ref, unpack_kv_ref
    from kernels.store_kv import store_kv_ref
    from kernels.triton_pack_kv import pack_kv, unpack_kv
    from kernels.triton_store_kv import store_kv

    for tokens in [512, 8192] if quick else [512, 2048, 8192, 32768]:
        key_cache, value_cache, tables = paged([tokens], dtype)
        slots = (tables[0, :, None] * BLOCK + torch.arange(BLOCK, device=DEVICE)).flatten()
        buffer = pack_kv_ref(key_cache, value_cache, slots)
        nbytes = 2 * buffer.nbytes  # K and V rows read once, written once
        yield compare(
            "pack_kv", f"{tokens} tokens", nbytes,
            pack_kv, pack_kv_ref, key_cache, value_cache, slots, buffer,  # index_select
        )  # fmt: skip
        yield compare(
            "unpack_kv", f"{tokens} tokens", nbytes,
            unpack_kv, unpack_kv_ref, buffer, key_cache, value_cache, slots,  # index_copy_
        )  # fmt: skip
        # store_kv's inputs as the model passes them: slices of the fused qkv projection
        qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
        key, value = qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
        yield compare(
            "store_kv", f"{tokens} tokens", nbytes,
            store_kv, store_kv_ref, key, value, key_cache, value_cache, slots,
        )  # fmt: skip


def elementwise_cases(dtype: torch.dtype, quick: bool) -> Iterator[dict]:
    from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
    from kernels.rotary import rotary_ref
    from kernels.triton_rms_norm import fused_add_rms_norm, rms_norm
    from kernels.triton_rotary import rotary

    for tokens in TOKENS[1::2] if quick else TOKENS:
        x = torch.randn(tokens, HIDDEN, dtype=dtype, device=DEVICE)
        residual, weight = torch.randn_like(x), torch.randn(HIDDEN, dtype=dtype, device=DEVICE)
        yield compare(
            "rms_norm", f"{tokens} x {HIDDEN}", 2 * x.nbytes,
            rms_norm, rms_norm_ref, x, weight, 1e-5,
        )  # fmt: skip
        yield compare(
            "fused_add_rms_norm", f"{tokens} x {HIDDEN}", 4 * x.nbytes,
            fused_add_rms_norm, fused_add_rms_norm_ref, x, residual, weight, 1e-5,
        )  # fmt: skip
        qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
        q = qkv[:, :HEADS]
        angles = torch.randn(tokens, 1, HEAD_DIM, device=DEVICE)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        yield compare(
            "rotary", f"{tokens} x {HEADS} heads", 2 * q.numel() * dtype.itemsize,
            rotary, rotary_ref, q, cos, sin,
        )  # fmt: skip


TARGETS = {"pack_kv": 80.0, "unpack_kv": 80.0}


def target_for(r: dict) -> float | None:
    if r["kernel"] == "decode_attention":
        batch, context = (int(w) for w in r["shape"].split()[1::2])
        return 70.0 if batch >= 32 and context >= 2048 else None
    return TARGETS.get(r["kernel"])


def print_table(rows: list[dict], copy_bw: float) -> None:
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    head = f"{'kernel':<20} {'shape':<30} {'triton ms':>10} {'torch ms':>10} {'speedup':>8}"
    print(head + f" {'triton %bw':>11} {'torch %bw':>10} {'target':>7}")
    for r in rows:
        line = f"{r['kernel']:<20} {r['shape']:<30} {r['triton_ms']:>10.4f} {r['torch_ms']:>10.4f}"
        line += f" {r['speedup']:>7.2f}x"
        if "triton_tflops" in r:  # against flash: ours / flash >= 0.8 asked
            line += f" {r['triton_tflops']:>7.0f} TF/s {r['torch_tflops']:>5.0f} TF/s"
            line += f" {'ok' if r['speedup'] >= 0.8 else 'MISS'} 0.8x"
        elif r["bytes"] is not None:
            line += f" {r['triton_pct_bw']:>10.1f}% {r['torch_pct_bw']:>9.1f}%"
            target = target_for(r)
            if target is not None:
                line += f" {'ok' if r['triton_pct_bw'] >= target else 'MISS':>4} {target:.0f}%"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a third of the cases")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", type=Path, default=Path("kernels_bench.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU; none is visible here.")
    dtype = getattr(torch, args.dtype)
    copy_bw = copy_bandwidth()
    rows = []
    for cases in (decode_cases, prefill_cases, flash_cases, copy_cases, elementwise_cases):
        for r in cases(dtype, args.quick):
            if r["bytes"] is not None:
                r["triton_pct_bw"] = 100 * r["bytes"] / (r["triton_ms"] * 1e-3) / copy_bw
                r["torch_pct_bw"] = 100 * r["bytes"] / (r["torch_ms"] * 1e-3) / copy_bw
            rows.append(r)
            torch.cuda.empty_cache()
    print_table(rows, copy_bw)
    report = {
        "device": torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "copy_bandwidth_bytes_per_s": copy_bw,
        "rows": rows,
    }
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
