"""CPU bf16 linears: tandem's decode/prefill kernel against oneDNN, at SmolLM2's shapes.

    python benchmarks/cpu_linear.py [--rows 1 16 200 2048] [--repeats 10] [--json out.json]

For each linear of SmolLM2-135M (fused q/k/v, o, fused gate/up, down, lm_head) and each row
count, the packed weight runs through `kernels/csrc/linear_bf16.cpp` (the block oneDNN sums in,
found by `onednn_block`) and through oneDNN's packed inner product, the path the engine takes
otherwise. Reported: best-of-N time and GFLOPS of each, their ratio, and whether the outputs are
bit-identical. Rows past `bf16_linear_max_rows()` (16 with AVX-512 BF16, where oneDNN's own
kernels are faster there) and shapes with no matching block are shown as oneDNN alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.packed_linear import PACK_BATCH_HINT, bf16_kernels, onednn_block  # noqa: E402

# (name, K, N): SmolLM2-135M's linears, q/k/v and gate/up fused as the engine runs them
SHAPES = [
    ("qkv", 576, 960),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
]


def best_seconds(call: Callable[[], torch.Tensor], repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 200, 2048])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    native = bf16_kernels(torch.bfloat16)
    if native is None:
        print("no bf16_linear on this CPU (no AVX-512, or no C++ build): nothing to compare")
        return 1
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"threads {torch.get_num_threads()}, bf16_linear rows <= {native.bf16_linear_max_rows()}")
    header = f"{'linear':>8} | {'K':>5} | {'N':>6} | {'rows':>5} | {'ours ms':>8} | {'GFLOPS':>6}"
    print(header + f" | {'oneDNN ms':>9} | {'GFLOPS':>6} | {'speed-up':>8} | same bits")
    for name, k, n in SHAPES:
        weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        block = onednn_block(native, n, k)
        ours = native.bf16_pack_weight(weight) if block is not None else None
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            flops = 2.0 * rows * k * n

            theirs = partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], "")
            base = best_seconds(theirs, args.repeats)
            row = {"linear": name, "k": k, "n": n, "rows": rows, "block": block,
                   "onednn_s": base, "onednn_gflops": flops / base / 1e9}  # fmt: skip
            if ours is not None and rows <= native.bf16_linear_max_rows():
                mine = partial(native.bf16_linear, x, ours, n, block)
                seconds = best_seconds(mine, args.repeats)
                row["ours_s"], row["ours_gflops"] = seconds, flops / seconds / 1e9
                row["speedup"], row["same_bits"] = base / seconds, torch.equal(mine(), theirs())
            rows_out.append(row)
            mine_cols = (
                f"{row['ours_s'] * 1e3:8.3f} | {row['ours_gflops']:6.1f}"
                if "ours_s" in row
                else f"{'-':>8} | {'-':>6}"
            )
            speedup = f"{row['speedup']:7.2f}x" if "speedup" in row else f"{'-':>8}"
            same = str(row.get("same_bits", "-")) if rows > 1 else "(1 row: batched bits)"
            print(
                f"{name:>8} | {k:5d} | {n:6d} | {rows:5d} | {mine_cols} | {base * 1e3:9.3f} | "
                f"{row['onednn_gflops']:6.1f} | {speedup} | {same}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows_out}))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
