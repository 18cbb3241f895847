"""The SLO planner in simulation: goodput and latency over time, planner vs static layouts.

    python benchmarks/planner.py [--json results/planner.json] [--plot-dir results/planner]

Two scales, both simulated (tandem simulate's engine: the real router and scheduler, steps
timed by a cost model):
- small: SmolLM2-135M single-thread workers (benchmarks/profiles/smollm2-cpu-1thread.json,
  measured by `tandem profile --threads 1` on the 2-core development VM), at most 4 workers;
  a step workload (1x, then 3x the rate of prefill-heavy requests, then 1x) and a sinusoid.
  The planner starts at 1P1D; the static layouts are every split of 4 workers, and 4 colocated.
- large: a Llama-70B-class profile on 8-GPU (TP8) workers (benchmarks/profiles/
  llama70b-class-tp8.json, coefficients from published H100 numbers: see its "info"), 128 GPUs =
  16 workers, the sinusoidal 1 <-> 24 req/s load with 8,000-token prompts and 1,000-token
  outputs; the planner's goodput as a share of the offered load, and the simulator's speed
  (simulated seconds per wall second).
Goodput: requests per second meeting both objectives (TTFT, and TPOT within the ITL limit).
Every deployment's coordinator knows the TTFT objective (`tandem serve --planner-slo` passes it
on): a request waiting for decode room past it is late, and the line serves the newest first
while its oldest is late (coordinator/room.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.config import GoodputSLO, LoadConfig  # noqa: E402
from planning.cost_model import StepCostModel  # noqa: E402
from planning.planner import Planner, PlannerConfig  # noqa: E402
from planning.transfer_model import TransferCostModel  # noqa: E402
from protocol.kv import KVLayout  # noqa: E402
from simulation.autoscale import PlannerDriver  # noqa: E402
from simulation.cluster import Outcome, Simulation  # noqa: E402
from simulation.deployment import (  # noqa: E402
    Costs,
    Deployment,
    EngineLimits,
    Overheads,
    Scenario,
)
from simulation.report import simulated_record  # noqa: E402
from simulation.workload import IdSpace, TokenIds, rate_profile  # noqa: E402

PROFILES = ROOT / "benchmarks" / "profiles"


def workload(rate, duration, lengths, seed=0):  # noqa: ANN001, ANN201
    """Poisson arrivals at rate(t); lengths(t) -> (prompt, output) tokens."""
    ids = IdSpace()

    def prompt(index: int, at: float) -> tuple[TokenIds, int]:
        n_in, n_out = lengths(at)
        return TokenIds(0, 0, ids.take(n_in), n_in), n_out

    return rate_profile(rate, duration, prompt, seed)


def run(scenario, requests, slo, planner_cfg=None, window=60.0):  # noqa: ANN001, ANN201
    sim = Simulation(scenario, requests, LoadConfig())
    driver = None
    if planner_cfg is not None:
        driver = PlannerDriver(Planner(scenario.costs.step, planner_cfg))
        sim.on_poll = progress(driver)
    started = time.perf_counter()
    outcome = sim.run()
    wall = time.perf_counter() - started
    record = simulated_record(outcome, scenario, LoadConfig(), (50.0, 99.0), slo, per_request=False)
    worker_seconds = _worker_seconds(driver, outcome, scenario)
    return {
        "goodput": record["request_goodput"],
        "offered": len(requests) / outcome.duration_s,
        "ttft_p99_ms": record["p99_ttft_ms"],
        "itl_p99_ms": record["p99_itl_ms"],
        "failed": record["failed"],
        "worker_seconds": worker_seconds,
        "actions": []
        if driver is None
        else [
            {
                "at": round(d.at, 1),
                "action": d.action,
                "layout": f"{d.prefill_workers}P{d.decode_workers}D",
                "reason": d.reason,
            }
            for d in driver.decisions
        ],
        "layouts": [] if driver is None else driver.layouts,
        "timeline": timeline(outcome, slo, window),
        "wall_s": wall,
        "simulated_s": outcome.duration_s,
        "events": outcome.num_events,
    }


def progress(driver: PlannerDriver):  # noqa: ANN201
    """The driver, plus a line on stderr every 100 simulated seconds (long runs)."""
    shown = [0.0]
    began = time.perf_counter()

    def poll(sim: Simulation) -> None:
        driver(sim)
        if sim.now - shown[0] >= 100.0:
            shown[0] = sim.now
            wall = time.perf_counter() - began
            print(f"  simulated {sim.now:.0f} s in {wall:.0f} s", file=sys.stderr, flush=True)

    return poll


def _worker_seconds(driver, outcome: Outcome, scenario: Scenario) -> float:  # noqa: ANN001
    if driver is None or not driver.layouts:
        return scenario.deployment.num_workers * outcome.duration_s
    times = [t for t, _, _ in driver.layouts] + [outcome.duration_s]
    return sum((b - a) * (p + d) for (a, p, d), b in zip(driver.layouts, times[1:], strict=True))


def timeline(outcome: Outcome, slo: GoodputSLO, window: float) -> list[dict]:
    """Per window of arrival time: requests, TTFT p99 and TPOT p99 (ms), share meeting the SLO."""
    rows = []
    runs = [r for r in outcome.runs if r.sent_at is not None]
    for start in np.arange(0.0, outcome.duration_s, window):
        inside = [r for r in runs if start <= r.sent_at < start + window]
        done = [r for r in inside if r.error is None and len(r.token_times) > 1]
        if not done:
            continue
        ttft = [(r.token_times[0] - r.sent_at) * 1e3 for r in done]
        tpot = [
            (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) * 1e3 for r in done
        ]
        good = sum(
            t <= (slo.ttft_ms or math.inf) and p <= (slo.tpot_ms or math.inf)
            for t, p in zip(ttft, tpot, strict=True)
        )
        rows.append(
            {
                "t": float(start),
                "requests": len(inside),
                "ttft_p99_ms": float(np.percentile(ttft, 99)),
                "tpot_p99_ms": float(np.percentile(tpot, 99)),
                "good": good / len(inside),
            }
        )
    return rows


def small(args: argparse.Namespace) -> dict:
    step = StepCostModel.load(PROFILES / "smollm2-cpu-1thread.json")
    slo = GoodputSLO(ttft_ms=args.small_ttft_ms, tpot_ms=args.small_itl_ms)
    cfg = PlannerConfig(
        slo.ttft_ms / 1e3,
        slo.tpot_ms / 1e3,
        max_workers=4,
        shrink_hold_s=30,
        decode_headroom_tokens=EngineLimits.decode_headroom_tokens,
    )
    phase = args.small_phase_s
    workloads = {
        "step": workload(
            lambda t: args.small_rate * (3 if phase <= t < 2 * phase else 1),
            3 * phase,
            lambda t: (900, 16) if phase <= t < 2 * phase else (300, 64),
        ),
        "sinusoid": workload(
            lambda t: args.small_rate * (1 + 1.5 * (1 - math.cos(2 * math.pi * t / (2 * phase)))),
            4 * phase,
            lambda t: (300, 64),
        ),
    }
    overheads = Overheads(worker_start=20.0, role_switch=2.0)
    results: dict = {}
    for name, requests in workloads.items():
        rows = {}
        limits = EngineLimits(2912)
        for layout in [(0, 4), (1, 3), (2, 2), (3, 1)]:
            deployment = Deployment(*layout, limits, late_after_s=cfg.ttft_slo_s)
            sc = Scenario(deployment, Costs(step), overheads)
            rows[sc.deployment.describe()] = run(sc, requests, slo)
        start = Deployment(1, 1, limits, late_after_s=cfg.ttft_slo_s)
        sc = Scenario(start, Costs(step), overheads)
        rows["planner (from 1P1D)"] = run(sc, requests, slo, cfg)
        results[name] = rows
        print(f"small/{name}:", file=sys.stderr, flush=True)
    return results


def large(args: argparse.Namespace) -> dict:
    step = StepCostModel.load(PROFILES / "llama70b-class-tp8.json")
    # 8 KV heads x 128 x (K, V) x bf16 = 4 KiB per token and layer; 80 layers; ~50 GB/s links.
    transfer = TransferCostModel(20e-6, 1 / 50e9, step.stats)
    kv = KVLayout(80, 8, 128, "bfloat16")
    slo = GoodputSLO(ttft_ms=args.large_ttft_ms, tpot_ms=args.large_itl_ms)
    cfg = PlannerConfig(
        slo.ttft_ms / 1e3,
        slo.tpot_ms / 1e3,
        max_workers=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        shrink_hold_s=120,
        decode_headroom_tokens=EngineLimits.decode_headroom_tokens,
    )
    period = args.large_period_s
    requests = workload(
        lambda t: 1 + 23 * (1 - math.cos(2 * math.pi * t / period)) / 2,
        args.large_duration_s,
        lambda t: (8000, 1000),
        seed=2,
    )
    limits = EngineLimits(60000, 16, 256, 8192)
    overheads = Overheads(worker_start=120.0, role_switch=5.0, step_gap=0.001)
    start = Deployment(4, 4, limits, gpus_per_worker=8, late_after_s=cfg.ttft_slo_s)
    sc = Scenario(start, Costs(step, transfer, kv), overheads)
    result = run(sc, requests, slo, cfg, window=period / 10)
    result["goodput_share"] = result["goodput"] / result["offered"]
    result["speed_x_real_time"] = result["simulated_s"] / result["wall_s"]
    print("large: done", file=sys.stderr, flush=True)
    return result


def format_tables(small_rows: dict, big: dict | None) -> str:
    lines = []
    for name, rows in small_rows.items():
        lines += [
            f"\n{name} (small, SmolLM2 CPU profile, <= 4 workers)",
            "",
            "| layout | goodput req/s | offered | TTFT p99 ms | ITL p99 ms | worker-s | actions |",
            "|---|---|---|---|---|---|---|",
        ]
        for layout, r in rows.items():
            lines.append(
                f"| {layout} | {r['goodput']:.2f} | {r['offered']:.2f} | {r['ttft_p99_ms']:.0f} | "
                f"{r['itl_p99_ms']:.0f} | {r['worker_seconds']:.0f} | {len(r['actions'])} |"
            )
    if big is not None:
        lines += [
            "",
            "large: 128 GPUs (16 TP8 workers), sinusoid 1<->24 req/s, 8000 in / 1000 out",
            f"goodput {big['goodput']:.2f} of {big['offered']:.2f} req/s offered "
            f"({big['goodput_share']:.0%}); TTFT p99 {big['ttft_p99_ms']:.0f} ms, ITL p99 "
            f"{big['itl_p99_ms']:.0f} ms; {len(big['actions'])} actions; simulated "
            f"{big['simulated_s']:.0f} s in {big['wall_s']:.1f} s wall = "
            f"{big['speed_x_real_time']:.0f}x real time ({big['events']} events)",
        ]
    return "\n".join(lines)


def plot(small_rows: dict, big: dict | None, args: argparse.Namespace) -> None:
    """One figure per workload: TTFT p99 and TPOT p99 per window (with the SLO as a dashed
    line) and the share of requests meeting it, every layout on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.plot_dir.mkdir(parents=True, exist_ok=True)
    cases = {f"small-{name}": (rows, args.small_ttft_ms, args.small_itl_ms)
             for name, rows in small_rows.items()}  # fmt: skip
    if big is not None:
        cases["large-sinusoid"] = ({"planner (from 4P4D)": big}, args.large_ttft_ms,
                                   args.large_itl_ms)  # fmt: skip
    for name, (rows, ttft_slo, itl_slo) in cases.items():
        fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
        for layout, r in rows.items():
            t = [w["t"] for w in r["timeline"]]
            style = {"linewidth": 2.2} if layout.startswith("planner") else {"alpha": 0.6}
            axes[0].plot(t, [w["ttft_p99_ms"] for w in r["timeline"]], label=layout, **style)
            axes[1].plot(t, [w["tpot_p99_ms"] for w in r["timeline"]], label=layout, **style)
            axes[2].plot(t, [w["good"] for w in r["timeline"]], label=layout, **style)
            for action in r["actions"]:
                axes[0].axvline(action["at"], color="grey", linestyle=":", linewidth=0.8)
        axes[0].axhline(ttft_slo, color="red", linestyle="--", linewidth=1)
        axes[1].axhline(itl_slo, color="red", linestyle="--", linewidth=1)
        axes[0].set(ylabel="TTFT p99 (ms)", yscale="log", title=name)
        axes[1].set(ylabel="TPOT p99 (ms)", yscale="log")
        axes[2].set(ylabel="share within SLO", xlabel="arrival time (s)", ylim=(0, 1.05))
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot_dir / f"{name}.png", dpi=110)
        plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small-rate", type=float, default=1.0, help="req/s at 1x")
    p.add_argument("--small-phase-s", type=float, default=120.0)
    p.add_argument("--small-ttft-ms", type=float, default=1000.0)
    p.add_argument("--small-itl-ms", type=float, default=60.0)
    p.add_argument("--large-duration-s", type=float, default=1800.0)
    p.add_argument("--large-period-s", type=float, default=900.0)
    p.add_argument("--large-ttft-ms", type=float, default=3000.0)
    p.add_argument("--large-itl-ms", type=float, default=100.0)
    p.add_argument("--skip-large", action="store_true")
    p.add_argument("--skip-small", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot-dir", type=Path, default=None, help="TTFT/ITL p99 over time, PNG")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    small_rows = {} if args.skip_small else small(args)
    big = None if args.skip_large else large(args)
    print(format_tables(small_rows, big))
    if args.plot_dir is not None:
        plot(small_rows, big, args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"settings": vars(args), "small": small_rows, "large": big}
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
