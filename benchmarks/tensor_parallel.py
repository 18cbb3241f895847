"""Tensor parallelism inside one engine: step times, output tok/s and the collectives' share.

    python benchmarks/tensor_parallel.py [--models overhead smollm2] [--batch 1 16] \
        [--input-len 256] [--output-len 64] [--json results/tensor_parallel.json]

Per model, the engine runs at TP 1 and at each --sizes entry (overhead: 2; SmolLM2-135M, whose
9 heads split only 3 ways: 3), in this one run so the ratios hold on a noisy machine. The
machine's cores are divided among the ranks (torch threads = cores / size), as `tandem serve`
does. Rank 0's steps are timed by wrapping the runner, and the time inside the all-reduces and
the vocabulary all-gather is counted by wrapping its collectives: that includes waiting for the
slowest rank. Served numbers for the same layouts: benchmarks/serving.py --targets colocated
colocated-tp2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {"overhead": (1, 2), "smollm2": (1, 3)}


class StepClock:
    """Wraps rank 0's runner and collectives: seconds per step, and inside collectives."""

    def __init__(self, runner) -> None:
        self.steps: list[tuple[int, float, float]] = []  # (rows, seconds, collective seconds)
        self._collective = 0.0
        comm = runner.model.comm
        for name in ("all_reduce", "gather_vocab"):
            setattr(comm, name, self._timed_collective(getattr(comm, name)))
        execute = runner.execute

        def timed_execute(plan, on_layer=None):
            self._collective = 0.0
            start = time.perf_counter()
            logits = execute(plan, on_layer)
            rows = sum(chunk.num_tokens for chunk in plan.chunks)
            self.steps.append((rows, time.perf_counter() - start, self._collective))
            return logits

        runner.execute = timed_execute

    def _timed_collective(self, collective):
        def timed(x):
            start = time.perf_counter()
            out = collective(x)
            self._collective += time.perf_counter() - start
            return out

        return timed


def run_size(model: Path, size: int, args: argparse.Namespace) -> list[dict]:
    import torch

    from engine.llm import LLM
    from protocol.sampling import SamplingParams

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    llm = LLM(
        model, dtype=args.dtype, tensor_parallel_size=size, enable_prefix_caching=False,
        max_num_seqs=max(args.batch),
    )  # fmt: skip
    clock = StepClock(llm.engine.runner)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    rows = []
    try:
        for batch in args.batch:
            prompts = [
                [rng.randrange(1000, 20000) for _ in range(args.input_len)] for _ in range(batch)
            ]
            llm.generate_ids(prompts, params)  # warm-up
            clock.steps.clear()
            start = time.perf_counter()
            outputs = llm.generate_ids(prompts, params)
            seconds = time.perf_counter() - start
            rows.append(_row(size, batch, outputs, seconds, clock.steps))
    finally:
        llm.close()
    return rows


def _row(size: int, batch: int, outputs, seconds: float, steps) -> dict:
    decode = [s for s in steps if s[0] == batch]  # every sequence one token
    prefill = [s for s in steps if s[0] > batch]
    ms = lambda values: 1000 * statistics.median(values) if values else None  # noqa: E731
    return {
        "tp": size,
        "batch": batch,
        "output_tok_s": sum(len(o.token_ids) for o in outputs) / seconds,
        "decode_step_ms": ms([s[1] for s in decode]),
        "decode_collective_ms": ms([s[2] for s in decode]),
        "prefill_step_ms": ms([s[1] for s in prefill]),
        "prefill_collective_ms": ms([s[2] for s in prefill]),
    }


def model_folder(name: str, work: Path) -> Path:
    from benchmarks.serving import write_overhead_model
    from engine.fetch import fetch_default_model

    smollm2 = fetch_default_model()
    if name == "smollm2":
        return smollm2
    return write_overhead_model(smollm2, work / "overhead")


def format_table(results: dict[str, list[dict]]) -> str:
    header = ("model", "TP", "batch", "tok/s", "vs TP1", "decode ms", "in coll.", "prefill ms",
              "in coll.")  # fmt: skip
    lines = [" | ".join(header)]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for name, rows in results.items():
        base = {r["batch"]: r["output_tok_s"] for r in rows if r["tp"] == 1}
        for r in rows:
            lines.append(
                " | ".join([
                    name, str(r["tp"]), str(r["batch"]), f"{r['output_tok_s']:.1f}",
                    f"{r['output_tok_s'] / base[r['batch']]:.2f}x", fmt(r["decode_step_ms"]),
                    fmt(r["decode_collective_ms"]), fmt(r["prefill_step_ms"]),
                    fmt(r["prefill_collective_ms"]),
                ])
            )  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            folder = model_folder(name, Path(tmp))
            results[name] = []
            for size in SIZES[name]:
                print(f"--- {name} TP {size}", file=sys.stderr, flush=True)
                results[name] += run_size(folder, size, args)
    print(format_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
