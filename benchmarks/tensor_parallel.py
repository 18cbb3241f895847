"""Tensor parallelism inside one engine: step times, output tok/s and the collectives' share.

    python benchmarks/tensor_parallel.py [--models overhead smollm2] [--batch 1 16] \
        [--input-len 256] [--output-len 64] [--transfer-len 1536] \
        [--json results/tensor_parallel.json]

Per model, the engine runs at TP 1 and at each --sizes entry (overhead: 2; SmolLM2-135M, whose
9 heads split only 3 ways: 3), in this one run so the ratios hold on a noisy machine. The
machine's cores are divided among the ranks (torch threads = cores / size), as `tandem serve`
does. Rank 0's steps are timed by wrapping the runner, and the time inside the all-reduces and
the vocabulary all-gather is counted by wrapping its collectives: that includes waiting for the
slowest rank. Served numbers for the same layouts: benchmarks/serving.py --targets colocated
colocated-tp2.

KV transfer between layouts (overhead model, in-process prefill and decode workers over gloo,
follower ranks as local processes): one --transfer-len prompt at a time, per layout pair
P1>D1, P2>D2 and P2>D1, in interleaved rounds. Reported: the decode side's transfer time (first
payload to last done frame, the slowest rank's), the handoff (reservation to the request
joining the decode batch: what TTFT pays beyond the prefill itself) and the bytes per route.
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

        def timed_execute(plan, on_layer=None, extra=None):
            self._collective = 0.0
            start = time.perf_counter()
            logits = execute(plan, on_layer, extra)
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


TRANSFER_LAYOUTS = ((1, 1), (2, 2), (2, 1))


def transfer_layouts(folder: Path, args: argparse.Namespace) -> list[dict]:
    """Per layout pair: median transfer and handoff seconds, and bytes per route."""
    import torch

    from decode.worker import DecodeWorker
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from kvtransfer.transport import make_transport
    from prefill.worker import PrefillWorker
    from protocol.messages import WorkRequest
    from protocol.sampling import SamplingParams
    from worker.rank_roles import spawn_with_roles

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every rank a core's share, as `tandem serve` gives them
    pairs, samples = {}, {layout: [] for layout in TRANSFER_LAYOUTS}
    transport = make_transport("gloo", torch.device("cpu"))
    for p_tp, d_tp in TRANSFER_LAYOUTS:

        def engine(size: int) -> LLMEngine:
            config = EngineConfig(
                folder, dtype=args.dtype, tensor_parallel_size=size, enable_prefix_caching=False,
                max_num_batched_tokens=args.transfer_len, max_model_len=args.transfer_len + 8,
            )  # fmt: skip
            return LLMEngine(config, spawn_with_roles)

        prefill = PrefillWorker(f"p{p_tp}", engine(p_tp), transport, 60)
        decode = DecodeWorker(f"d{d_tp}", engine(d_tp), transport, 60)
        pairs[(p_tp, d_tp)] = (prefill, decode)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(1)
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up every pair
            for layout, (prefill, decode) in pairs.items():
                prompt = [rng.randrange(1000, 20000) for _ in range(args.transfer_len)]
                request = WorkRequest(f"t{round_}-{layout}", prompt, params)
                seconds_before = decode.transfers.seconds.total
                start = time.perf_counter()
                ticket = decode.reserve(request, prefill.worker_id, None, layout[0]).result(60)
                prefill.submit(request, ticket, lambda *_: None)
                while not any(u.request_id == request.request_id
                              for u in decode.take_updates(timeout=60)):  # fmt: skip
                    pass
                handoff = time.perf_counter() - start
                transfer = decode.transfers.seconds.total - seconds_before
                if round_:
                    samples[layout].append((transfer, handoff))
        rows = []
        for layout, (_, decode) in pairs.items():
            transfers, handoffs = zip(*samples[layout], strict=True)
            rows.append({
                "layout": f"P{layout[0]}>D{layout[1]}",
                "transfer_ms": 1000 * statistics.median(transfers),
                "handoff_ms": 1000 * statistics.median(handoffs),
                "route_bytes": dict(decode.route_bytes),
            })  # fmt: skip
        return rows
    finally:
        for prefill, decode in pairs.values():
            for worker in (prefill, decode):
                worker.shutdown()
                worker.engine.close()
        torch.set_num_threads(threads)


def format_transfers(rows: list[dict]) -> str:
    base = rows[0]["transfer_ms"]
    lines = ["layout | transfer ms | vs P1>D1 | handoff ms | bytes per route"]
    for r in rows:
        routes = ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in sorted(r["route_bytes"].items()))
        lines.append(
            f"{r['layout']} | {r['transfer_ms']:.1f} | {r['transfer_ms'] / base:.2f}x | "
            f"{r['handoff_ms']:.1f} | {routes}"
        )
    return "\n".join(lines)


def model_folder(name: str, work: Path) -> Path:
    from benchmarks.serving import write_random_model
    from engine.fetch import fetch_default_model

    smollm2 = fetch_default_model()
    if name == "smollm2":
        return smollm2
    return write_random_model(smollm2, work / "overhead")


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
    p.add_argument("--transfer-len", type=int, default=1536, help="0: skip the transfer table")
    p.add_argument("--rounds", type=int, default=5, help="transfer rounds per layout pair")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results: dict[str, list[dict]] = {}
    transfers: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            folder = model_folder(name, Path(tmp))
            results[name] = []
            for size in SIZES[name]:
                print(f"--- {name} TP {size}", file=sys.stderr, flush=True)
                results[name] += run_size(folder, size, args)
        if args.transfer_len:
            print("--- KV transfer between layouts", file=sys.stderr, flush=True)
            transfers = transfer_layouts(model_folder("overhead", Path(tmp)), args)
    print(format_table(results))
    if transfers:
        print()
        print(format_transfers(transfers))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)},
                                         "results": results, "transfers": transfers},
                                        indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
