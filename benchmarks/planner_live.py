"""The live SLO planner on real servers: `tandem serve --planner on` against static layouts.

    python benchmarks/planner_live.py [--phase-s 60] [--json results/planner_live.json]

Every layout is a real `tandem serve` (SmolLM2-135M-Instruct, single-thread workers on this
machine's cores), driven by the same seeded step workload over HTTP: `--rate` req/s of 300-token
prompts / 64 output tokens, then 3x the rate of prefill-heavy 900 / 16 requests, then back;
Poisson arrivals, greedy, ignore_eos, streamed. Layouts: static 1P1D and 2P1D (planner off, the
objective known to their queues), and the planner from 1P1D (`--planner on`, at most 3 workers,
the CPU profile in benchmarks/profiles/). Reported per layout: goodput (requests/s meeting TTFT
and TPOT limits), TTFT p99 per phase, the planner's actions with their times, and how long after
the step began the TTFT p99 of 10 s arrival windows was back under the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.client import send_request, stream_client  # noqa: E402
from loadtest.serve_process import ServeProcess  # noqa: E402
from loadtest.target import Target  # noqa: E402

PROFILE = ROOT / "benchmarks" / "profiles" / "smollm2-cpu-1thread.json"
VOCAB = 49152


def schedule(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(send time, prompt token ids, output tokens), seeded: every layout gets the same."""
    rng = random.Random(7)
    phase = args.phase_s
    out, t = [], 0.0
    while True:
        heavy = phase <= t < 2 * phase
        rate = args.rate * (3 if heavy else 1)
        t += rng.expovariate(rate)
        if t >= 3 * phase:
            return out
        heavy = phase <= t < 2 * phase
        n_in, n_out = (900, 16) if heavy else (300, 64)
        out.append((t, [rng.randrange(1000, VOCAB) for _ in range(n_in)], n_out))


async def drive(url: str, requests: list, args: argparse.Namespace) -> tuple[list, list, dict]:
    """Sends every request at its time; polls /admin/pools every 2 s. Returns (results with
    their send offsets, pool sizes over time, /admin/planner at the end with its decision times
    moved to the run's clock)."""
    target = Target(f"{url}/v1/completions", "model", {}, is_chat=False)
    layouts: list[tuple[float, int, int]] = []
    start = time.perf_counter()

    async def one(at: float, ids: list[int], n_out: int):  # noqa: ANN202
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        payload = {"prompt": ids, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
                   "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        return at, await send_request(session, target, payload, len(ids), 300.0)

    async def watch(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            while not done.is_set():
                try:
                    workers = (await http.get("/admin/pools")).json()["workers"]
                    serving = [w["pool"] for w in workers if w["state"] == "serving"]
                    t = time.perf_counter() - start
                    layouts.append((t, serving.count("prefill"), serving.count("decode")))
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                await asyncio.sleep(2.0)

    done = asyncio.Event()
    async with stream_client(None) as session:
        watcher = asyncio.ensure_future(watch(done))
        results = await asyncio.gather(*(one(*r) for r in requests))
        done.set()
        await watcher
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        reply = await http.get("/admin/planner")
        now = time.perf_counter() - start
    planner = reply.json() if reply.status_code == 200 else {}
    for d in planner.get("decisions", []):
        d["at"] = round(now - (planner["now"] - d["at"]), 1)
    return list(results), layouts, planner


def summarise(results: list, layouts: list, planner: dict | None, args) -> dict:  # noqa: ANN001
    phase, ttft_slo, tpot_slo = args.phase_s, args.ttft_ms / 1e3, args.tpot_ms / 1e3
    rows = []
    for at, r in results:
        ok = r.error is None and r.ttft is not None
        tpot = (r.latency - r.ttft) / max(len(r.itl), 1) if ok and r.latency else None
        rows.append((at, r.ttft if ok else math.inf, tpot if tpot is not None else math.inf))
    good = sum(t <= ttft_slo and p <= tpot_slo for _, t, p in rows)
    phases = {}
    for i, name in enumerate(("before", "step", "after")):
        ttfts = [t for at, t, _ in rows if i * phase <= at < (i + 1) * phase]
        phases[name] = float(np.percentile(ttfts, 99) * 1e3) if ttfts else None
    windows = []
    for start in np.arange(0.0, 3 * phase, 10.0):
        ttfts = [t for at, t, _ in rows if start <= at < start + 10.0]
        if ttfts:
            windows.append((float(start), float(np.percentile(ttfts, 99))))
    violated = [w for w, p99 in windows if phase <= w < 2 * phase and p99 > ttft_slo]
    recovered = None
    if violated:
        later = [w for w, p99 in windows if w > violated[0] and w < 2 * phase and p99 <= ttft_slo]
        recovered = later[0] + 10.0 - phase if later else None
    actions = [
        {
            "at": d["at"],
            "action": d["action"],
            "layout": f"{d['prefill_workers']}P{d['decode_workers']}D",
            "outcome": d["outcome"],
            "reason": d["reason"],
        }
        for d in (planner or {}).get("decisions", [])
    ]
    return {
        "requests": len(rows),
        "failed": sum(r.error is not None for _, r in results),
        "goodput": good / (3 * phase),
        "offered": len(rows) / (3 * phase),
        "ttft_p99_ms": phases,
        "ttft_windows": windows,
        "step_recovered_after_s": recovered,
        "step_violated": bool(violated),
        "layouts": layouts,
        "actions": actions,
    }


def run_layout(name: str, flags: list[str], model: Path, requests: list, args, work: Path) -> dict:  # noqa: ANN001
    serve = ["--model", str(model), "--threads-per-worker", "1", *flags]
    with ServeProcess(serve, work / f"{name}.log") as server:
        server.wait_healthy(300)
        results, layouts, planner = asyncio.run(drive(server.url, requests, args))
    summary = summarise(results, layouts, planner or None, args)
    if planner:
        summary["planner"] = {k: planner[k] for k in ("counts", "profile_factor")}
    print(f"{name}: done", file=sys.stderr, flush=True)
    return summary


def format_table(rows: dict, args) -> str:  # noqa: ANN001
    lines = [
        f"step workload: {args.rate:g} -> {3 * args.rate:g} (prefill-heavy) -> {args.rate:g} "
        f"req/s, {args.phase_s:g} s phases; SLO TTFT p99 {args.ttft_ms:g} ms, TPOT "
        f"{args.tpot_ms:g} ms",
        "",
        "| layout | goodput req/s | offered | TTFT p99 before / step / after ms | "
        "back under SLO after step | failed | workers seen |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        p = r["ttft_p99_ms"]
        phases = " / ".join("-" if p[k] is None else f"{p[k]:.0f}" for k in p)
        back = ("never violated" if not r["step_violated"] else
                "not within the step" if r["step_recovered_after_s"] is None else
                f"{r['step_recovered_after_s']:.0f} s")  # fmt: skip
        seen = sorted({f"{pp}P{d}D" for _, pp, d in r["layouts"]})
        lines.append(
            f"| {name} | {r['goodput']:.2f} | {r['offered']:.2f} | {phases} | {back} | "
            f"{r['failed']} | {', '.join(seen)} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="default: the fetched SmolLM2-135M-Instruct")
    p.add_argument("--rate", type=float, default=1.0, help="req/s at 1x")
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=80.0)
    p.add_argument("--layouts", default="static-1P1D,static-2P1D,planner")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from engine.fetch import fetch_default_model

        args.model = fetch_default_model()
    slo = f"ttft_p99={args.ttft_ms:g}ms,itl_p99={args.tpot_ms:g}ms"
    # Every layout knows the TTFT objective (its queues serve the newest first while the oldest
    # is late: coordinator/room.py, engine/scheduler.py); only the planner's layout acts on it.
    knows_slo = ["--planner", "off", "--planner-slo", slo, "--planner-profile", str(PROFILE)]
    options = {
        "static-1P1D": ["--prefill-workers", "1", "--decode-workers", "1", *knows_slo],
        "static-2P1D": ["--prefill-workers", "2", "--decode-workers", "1", *knows_slo],
        "planner": [
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--planner",
            "on",
            "--planner-slo",
            slo,
            "--planner-profile",
            str(PROFILE),
            "--planner-max-workers",
            "3",
        ],  # fmt: skip
    }
    requests = schedule(args)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts.split(","):
            rows[name] = run_layout(name, options[name], args.model, requests, args, Path(tmp))
    print(format_table(rows, args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": vars(args), "layouts": rows}, indent=2,
                                        default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
