"""Simulator fidelity: `tandem simulate` against real `tandem serve` runs of the same workload.

    python benchmarks/simulator_fidelity.py [--model DIR] [--layouts colocated 1P1D 2P1D] \
        [--mixes short long] [--loads 0.3 0.6 0.9] [--duration 90] [--json results/fidelity.json]

Per layout, one `tandem serve` process:
  1. calibration: `tandem bench` at --max-concurrency 16 (saturating); its request throughput is
     the layout's capacity, and the engine steps it ran (GET /admin/telemetry) are fitted into the
     layout's step cost model, with the host gap between the decode workers' steps (what `tandem
     profile --from-telemetry` does; the model is never fitted on the runs it is scored on).
     Disaggregated layouts share this machine's two cores, and a step of one pool that starts
     while the other pool is in a step runs slower (a decode step beside a prefill step 3x, on
     median). So the model is fitted on steps that ran alone: prefill steps from a run just
     before, whose requests stop at their first token (nothing decodes), and the decode steps
     of the calibration run that started beside no prefill step; the median slowdown over it of
     the others becomes the simulated `prefill_interference` (decode steps beside prefill) and
     `decode_interference` (prefill steps beside decode); `--interference mean` takes their
     mean, `draw` all of them, each slowed step drawing one. `--no-fit-interference`: one
     model fitted on every step, no interference (what docs/architecture.md compares it with).
     And the median handover of the calibration run's requests (`tandem:kv_handover_seconds`,
     the end of a prefill step to the first token leaving the coordinator: the KV's last
     layers, the result's way back, the dispatch) becomes the simulated handover
     (`--no-handover`: 0);
     Then as many prompts again with Poisson arrivals at --calibration-open-loop of that
     capacity (0.9): a closed loop runs in waves whose prompts prefill while nothing decodes,
     where the loads' arrivals prefill beside decode steps, and a worker pacing its cores runs
     those on fewer threads; the models are fitted on both runs' steps;
  2. per mix and load: `tandem bench` with Poisson arrivals at that fraction of capacity, and the
     simulator on the very same prompts and arrival times (same dataset flags, tokenizer, seed).
Reported: TTFT and ITL p50/p99 real vs simulated and their errors, and SLO attainment (share of
requests with TTFT and TPOT under --slo-ttft-ms / --slo-tpot-ms) in both, with its difference in
percentage points; and, real (the run's telemetry) and simulated, the share of decode steps
that started while a prefill worker was in a step, and the prefill pool's steps and busy
seconds. Targets (issue 17): TTFT p50 within 10%, p99 within 15%; ITL p50 within 5%, p99
within 10%; attainment within 2 points.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.config import DatasetConfig, LoadConfig, MixedSpec, RandomSpec  # noqa: E402
from loadtest.datasets import sample_requests  # noqa: E402
from loadtest.serve_process import ServeProcess  # noqa: E402
from loadtest.token_count import LocalTokenizer  # noqa: E402
from planning.cost_model import ProfileInfo, StepCostModel, fit  # noqa: E402
from planning.records import split_every  # noqa: E402
from protocol.telemetry import StepRecord  # noqa: E402
from simulation.cluster import Outcome, Simulation  # noqa: E402
from simulation.deployment import Costs, Deployment, EngineLimits, Overheads, Scenario  # noqa: E402
from simulation.report import simulated_record  # noqa: E402
from simulation.workload import from_samples  # noqa: E402

START_TIMEOUT_S = 600.0
# Served and simulated alike (the fidelity numbers in docs/architecture.md were measured with it,
# before tandem serve's CPU default became 256).
STEP_TOKENS = 2048
LAYOUTS = {"colocated": (0, 1), "1P1D": (1, 1), "2P1D": (2, 1), "1P2D": (1, 2)}
MIXES = {  # name: (dataset flags, spec)
    "short": (
        ["--dataset-name", "random", "--random-input-len", "100", "--random-output-len", "64",
         "--random-range-ratio", "0.5"],
        RandomSpec(input_len=100, output_len=64, range_ratio=0.5),
    ),
    "long": (
        ["--dataset-name", "mixed", "--mixed-short-len", "100", "--mixed-long-len", "800",
         "--mixed-long-fraction", "0.2", "--random-output-len", "64"],
        MixedSpec(short_len=100, long_len=800, long_fraction=0.2, output_len=64),
    ),
}  # fmt: skip
CALIBRATION_CONCURRENCY = 16
MIN_BESIDE = 5  # decode steps beside a prefill step needed to measure their slowdown
MIN_THREAD_STEPS = 20  # steps on one thread count needed to fit a model of its own
MIN_THREAD_NOISE = 20  # steps of one kind on one thread count needed to draw from their spread
MAX_STEP_GAP_S = 0.05  # longer pauses between steps are idle time, not per-step host work
POOL_STATS = (
    "decode_beside",
    "decode_fewer_threads",
    "decode_step_ms",
    "prefill_steps",
    "prefill_seconds",
)
TARGETS = {"ttft_p50": 10, "ttft_p99": 15, "itl_p50": 5, "itl_p99": 10}  # % error allowed


def bench(url: str, model: Path, flags: list[str], out: Path, extra: list[str]) -> dict:
    command = [
        sys.executable, "-m", "cli.main", "bench", "--base-url", url, "--model", model.name,
        "--tokenizer", str(model), *flags, *extra, "--ignore-eos", "--temperature", "0",
        "--disable-tqdm",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    with open(out.with_suffix(".txt"), "w") as report:
        done = subprocess.run(command, cwd=ROOT, stdout=report, stderr=report, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tandem bench failed (exit {done.returncode}); see {report.name}")
    return json.loads(out.read_text())


def step_gap(records: list[StepRecord]) -> float:
    """Median host time between one step's end and the next one's start, while busy."""
    gaps = [
        b.end - b.seconds - a.end
        for a, b in zip(records[:-1], records[1:], strict=True)
        if 0 <= b.end - b.seconds - a.end < MAX_STEP_GAP_S
    ]
    return statistics.median(gaps) if gaps else 0.0


def beside(per_worker: dict[str, list[StepRecord]], pool: str, other: str) -> dict[int, float]:
    """The steps of `pool`'s workers that started while one of `other`'s was in a step (pools
    told by the worker names: "prefill-0", "decode-1"): id -> seconds from its start to the end
    of the last such step of `other` (the overlap simulation/interference.py slows)."""
    spans = [
        sorted((s.end - s.seconds, s.end) for s in steps)
        for worker, steps in per_worker.items()
        if worker.startswith(other)
    ]
    starts = [[a for a, _ in span] for span in spans]

    def until(t: float) -> float | None:
        ends = []
        for span, begun in zip(spans, starts, strict=True):
            i = bisect.bisect_right(begun, t) - 1
            if i >= 0 and span[i][1] > t:
                ends.append(span[i][1])
        return max(ends) - t if ends else None

    found = {}
    for worker, steps in per_worker.items():
        if worker.startswith(pool):
            for s in steps:
                overlap = until(s.end - s.seconds)
                if overlap is not None:
                    found[id(s)] = overlap
    return found


def oversubscription(per_worker: dict[str, list[StepRecord]], cores: int) -> dict[int, float]:
    """id(step) -> how much slower than on cores of its own it ran for more workers computing
    than cores (workers pacing `cores` cores run one thread each at least, so k > cores workers
    in a step share them: each runs at cores / k). Over the step's span, as the simulator times
    it (Simulation._repace re-times a step whenever another starts or ends): its seconds over
    the work done, the integral of min(1, cores / k(t))."""
    spans = {
        w: sorted((s.end - s.seconds, s.end) for s in steps) for w, steps in per_worker.items()
    }
    starts = {w: [a for a, _ in span] for w, span in spans.items()}
    factors = {}
    for worker, steps in per_worker.items():
        for s in steps:
            began, ended = s.end - s.seconds, s.end
            if ended <= began:
                factors[id(s)] = 1.0
                continue
            # (time, +1 / -1): another worker's step starts / ends within this one. A worker's
            # steps never overlap, so walking back from the last one begun before this one
            # ends may stop at the first that ended before this one began.
            changes = []
            for other, span in spans.items():
                if other == worker:
                    continue
                i = bisect.bisect_left(starts[other], ended) - 1
                while i >= 0 and span[i][1] > began:
                    changes += [(max(span[i][0], began), 1), (min(span[i][1], ended), -1)]
                    i -= 1
            work, k, at = 0.0, 1, began
            for t, step_change in sorted(changes, key=lambda c: (c[0], -c[1])):
                work += (t - at) * min(1.0, cores / k)
                k, at = k + step_change, t
            work += (ended - at) * min(1.0, cores / k)
            factors[id(s)] = (ended - began) / work
    return factors


@dataclass(frozen=True)
class Calibration:
    model: StepCostModel
    # Each step's time over the model's, of the decode steps that started beside a prefill step
    # and of the prefill steps beside a decode step (1: too few to tell, or not measured).
    prefill_interference: float | tuple[float, ...]
    decode_interference: float | tuple[float, ...]
    step_gap: float
    fitted: int  # steps the model was fitted on
    # Workers that paced their cores (their steps ran on different thread counts): a model
    # per thread count, each fitted on every step that ran on that many (what the simulator
    # takes then, with no interference factor: the thread count is the interference).
    by_threads: dict[int, StepCostModel] = field(default_factory=dict)
    # each fitted step's time over its model's, decode steps and steps with prompt tokens
    # apart: the spread the simulator draws from
    step_noise: tuple[float, ...] = ()
    prefill_step_noise: tuple[float, ...] = ()
    # the same per thread count with a model (by_threads), each kind's spread empty where the
    # count has fewer than MIN_THREAD_NOISE steps of it (the pooled one is drawn then)
    thread_noise: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict
    )


def telemetry(url: str) -> dict:
    """GET /admin/telemetry: each worker's recent engine steps."""
    return httpx.get(f"{url}/admin/telemetry?limit=4096", timeout=30, trust_env=False).json()


def steps_of(reply: dict) -> dict[str, list[StepRecord]]:
    return {
        worker: [StepRecord(**{k: s[k] for k in StepRecord._fields}) for s in w.get("steps", [])]
        for worker, w in reply["workers"].items()
    }


def pools_real(
    per_worker: dict[str, list[StepRecord]], start: float, end: float, costs: Costs
) -> dict[str, float | None]:
    """Of the steps that ended in [start, end]: the share of decode steps that started while a
    prefill worker was in a step and of those on fewer threads than the most, their mean time
    and the median of their time over what `costs` gives them, and the prefill steps' count and
    seconds (None without a prefill pool). `per_worker`: each worker's steps (`steps_of`)."""
    if not any(w.startswith("prefill") for w in per_worker):
        return dict.fromkeys(POOL_STATS)
    ids = beside(per_worker, "decode", "prefill")

    def in_run(pool: str) -> list[StepRecord]:
        return [s for w, steps in per_worker.items() if w.startswith(pool)
                for s in steps if start <= s.end <= end]  # fmt: skip

    decode, prefill = in_run("decode"), in_run("prefill")
    most = max((s.threads for s in decode), default=0)
    # Paced workers: each step against its thread count's model and the oversubscription the
    # simulator adds; else against the one model as it is.
    shared = oversubscription(per_worker, max(costs.by_threads)) if costs.by_threads else {}
    over_model = [
        s.seconds / max(costs.step_on(s.threads).predict(s), 1e-9) / shared.get(id(s), 1.0)
        for s in decode
    ]
    return {
        "decode_step_ms": 1e3 * statistics.mean(s.seconds for s in decode) if decode else None,
        # how far the real decode steps ran from the model the simulator gave them (median)
        "decode_vs_model": statistics.median(over_model) if over_model else None,
        "decode_beside": sum(id(s) in ids for s in decode) / len(decode) if decode else None,
        "decode_fewer_threads": sum(s.threads < most for s in decode) / len(decode)
        if decode
        else None,
        "prefill_steps": len(prefill),
        "prefill_seconds": sum(s.seconds for s in prefill),
    }


def pools_sim(outcome: Outcome) -> dict[str, float | None]:
    """The same in a simulation (the decode steps it slowed as beside a prefill step)."""
    workers = outcome.workers.values()
    decode = [w for w in workers if w.pool == "decode"]
    prefill = [w for w in workers if w.pool == "prefill"]
    steps = sum(w.num_steps for w in decode)
    if not prefill:
        return dict.fromkeys(POOL_STATS)
    used: dict[int, int] = {}
    for w in decode:
        for threads, count in w.threads_used.items():
            used[threads] = used.get(threads, 0) + count
    fewer = sum(c for t, c in used.items() if t < max(used)) if used else None
    return {
        "decode_step_ms": 1e3 * sum(w.busy_seconds for w in decode) / steps if steps else None,
        "decode_vs_model": 1.0,  # by construction, slowdowns aside
        "decode_beside": sum(w.steps_beside for w in decode) / steps if steps else None,
        "decode_fewer_threads": fewer / sum(used.values()) if fewer is not None else None,
        "prefill_steps": sum(w.num_steps for w in prefill),
        "prefill_seconds": sum(w.busy_seconds for w in prefill),
    }


def calibrate(
    reply: dict,
    name: str,
    interference: bool,
    alone: tuple[float, float] | None,
    by_threads: bool = True,
) -> Calibration:
    """The layout's step model, fitted on its served steps, and the step gap. `by_threads`, when
    the steps ran on different thread counts (workers pacing their cores): one model per count,
    fitted on that count's steps (MIN_THREAD_STEPS at least), no interference. Else
    `interference`: the model is fitted on steps that ran beside no step of the other pool
    (prefill steps from the run in the `alone` window of wall time, where nothing decodes;
    decode steps after it that started beside no prefill step), and the slowdowns over it of
    the steps that did are each pool's interference factors; else every step is fitted and
    there is none. `reply`: GET /admin/telemetry after the calibration run."""
    per_worker = steps_of(reply)
    # The host time between steps, from the workers that step back to back while busy: a
    # prefill worker's pauses are mostly waits for the next prompt.
    gaps = [
        step_gap(sorted(records, key=lambda s: s.end))
        for worker, records in per_worker.items()
        if not worker.startswith("prefill") and len(records) > 2
    ]
    gap = statistics.median(gaps) if gaps else 0.0
    steps = [s for records in per_worker.values() for s in records]
    counts = sorted({s.threads for s in steps if s.threads})
    if by_threads and len(counts) > 1:
        paced = calibrate_paced(per_worker, steps, counts, name, gap)
        if paced is not None:
            return paced
    if not interference or alone is None:
        train, heldout = split_every(steps, 5)
        model = fit(train, heldout, ProfileInfo(model=name, source="telemetry"))
        return Calibration(model, 1.0, 1.0, gap, len(steps), {}, *spreads(steps, model))
    decode_beside = beside(per_worker, "decode", "prefill")
    prefill_beside = beside(per_worker, "prefill", "decode")
    start, end = alone
    prefill_ids = {id(s) for w, records in per_worker.items() if w.startswith("prefill")
                   for s in records}  # fmt: skip
    records = [
        s
        for s in steps
        if (id(s) in prefill_ids and start <= s.end <= end and id(s) not in prefill_beside)
        or (id(s) not in prefill_ids and s.end > end and id(s) not in decode_beside)
    ]
    train, heldout = split_every(records, 5)
    model = fit(train, heldout, ProfileInfo(model=name, source="telemetry"))

    def slowdown(overlaps: dict[int, float], pool: str) -> float | tuple[float, ...]:
        """Each step's time over the model's: of the prefill steps beside a decode step, and of
        the decode steps that ended inside the prefill step they started in (the simulator
        slows a decode step while that step lasts: simulation/interference.py)."""
        factors = [
            s.seconds / max(model.predict(s), 1e-9)
            for s in steps
            if id(s) in overlaps
            and s.end > end
            and (pool == "prefill" or s.seconds <= overlaps[id(s)])
        ]
        return tuple(sorted(factors)) if len(factors) >= MIN_BESIDE else 1.0

    return Calibration(
        model,
        slowdown(decode_beside, "decode"),
        slowdown(prefill_beside, "prefill"),
        gap,
        len(records),
        {},
        *spreads(records, model),
    )


def calibrate_paced(
    per_worker: dict[str, list[StepRecord]],
    steps: list[StepRecord],
    counts: list[int],
    name: str,
    gap: float,
) -> Calibration | None:
    """`calibrate` for workers that paced their cores (`steps`: every worker's, which ran on
    the thread `counts`): a model per thread count with MIN_THREAD_STEPS steps (None if there
    is none), each fitted on the steps of that count as if their threads had the cores to
    themselves (the simulator adds the oversubscription back: Simulation._oversubscribed), and
    the spreads around them, pooled and per count."""
    shared = oversubscription(per_worker, max(counts))
    alone_steps = [s._replace(seconds=s.seconds / shared[id(s)]) for s in steps]
    models = {}
    for threads in counts:
        group = [s for s in alone_steps if s.threads == threads]
        if len(group) >= MIN_THREAD_STEPS:
            train, heldout = split_every(group, 5)
            info = ProfileInfo(model=f"{name}-{threads}t", source="telemetry")
            models[threads] = fit(train, heldout, info)
    if not models:
        return None
    fitted = [s for s in alone_steps if s.threads in models]
    by_count = {}
    for threads, model in models.items():
        kinds = spreads([s for s in fitted if s.threads == threads], model)
        by_count[threads] = tuple(k if len(k) >= MIN_THREAD_NOISE else () for k in kinds)
    noise = spreads(fitted, lambda s: models[s.threads])
    return Calibration(models[max(models)], 1.0, 1.0, gap, len(fitted), models, *noise, by_count)


def spreads(
    steps: list[StepRecord], model: StepCostModel | Callable[[StepRecord], StepCostModel]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each step's time over what its model predicts (one model, or one per step), sorted: of
    the decode steps, and of the steps with prompt tokens."""
    pick = model if callable(model) else lambda s: model

    def ratios(kind: list[StepRecord]) -> tuple[float, ...]:
        return tuple(sorted(s.seconds / max(pick(s).predict(s), 1e-9) for s in kind))

    return (
        ratios([s for s in steps if not s.prefill_tokens]),
        ratios([s for s in steps if s.prefill_tokens]),
    )


def simulated(factors: float | tuple[float, ...], how: str) -> float | tuple[float, ...]:
    """What the simulated deployment gets of the factors measured: "draw", all of them (each
    slowed step draws one); "median" or "mean", that one factor (never below 1)."""
    if how == "draw" or not isinstance(factors, tuple):
        return factors
    one = statistics.median(factors) if how == "median" else statistics.fmean(factors)
    return max(1.0, one)


def summary(factors: float | tuple[float, ...]) -> dict[str, float]:
    """Measured interference factors in a report: how many, and their median and p90."""
    values = factors if isinstance(factors, tuple) else (factors,)
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "median": statistics.median(values),
        "p90": float(np.percentile(values, 90)),
    }


def handover_buckets(url: str) -> dict[float, float]:
    """The coordinator's `tandem:kv_handover_seconds` histogram: cumulative count by bound."""
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem:kv_handover_seconds_bucket"
    }


def bucket_median(before: dict[float, float], after: dict[float, float]) -> float:
    """The median of what was observed between two reads of a cumulative histogram, linear
    within its bucket; 0 when nothing was."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    if not counts or counts[-1][1] <= 0:
        return 0.0
    half = counts[-1][1] / 2
    low, below = 0.0, 0.0
    for bound, count in counts:
        if count >= half:
            if bound == float("inf"):
                return low
            return low + (bound - low) * (half - below) / max(count - below, 1e-12)
        low, below = bound, count
    return low


def attainment(record: dict, ttft_ms: float, tpot_ms: float) -> float:
    good = 0
    rows = zip(record["ttfts"], record["latencies"], record["output_lens"], strict=True)
    for ttft, latency, n_out in rows:
        tpot = (latency - ttft) / (n_out - 1) if n_out > 1 else 0.0
        good += ttft > 0 and ttft * 1e3 <= ttft_ms and tpot * 1e3 <= tpot_ms
    return good / max(len(record["ttfts"]), 1)


def error_pct(real: float, sim: float) -> float:
    return (sim - real) / real * 100 if real else 0.0


def compare(real: dict, sim: dict, args: argparse.Namespace) -> dict:
    row: dict[str, float] = {}
    for metric in ("ttft", "itl"):
        for pct, key in (("p50", f"median_{metric}_ms"), ("p99", f"p99_{metric}_ms")):
            r, s = real[key], sim[key]
            row[f"{metric}_{pct}_real"], row[f"{metric}_{pct}_sim"] = r, s
            row[f"{metric}_{pct}_err_pct"] = error_pct(r, s)
    row["slo_real"] = attainment(real, args.slo_ttft_ms, args.slo_tpot_ms)
    row["slo_sim"] = attainment(sim, args.slo_ttft_ms, args.slo_tpot_ms)
    row["slo_diff_pts"] = (row["slo_sim"] - row["slo_real"]) * 100
    row["tok_s_real"], row["tok_s_sim"] = real["output_throughput"], sim["output_throughput"]
    return row


def run_layout(model: Path, layout: str, args: argparse.Namespace, work: Path) -> list[dict]:
    prefill, decode = LAYOUTS[layout]
    mode = "colocated" if prefill == 0 else "disaggregated"
    serve = ["--model", str(model), "--mode", mode, "--prefill-workers", str(prefill),
             "--decode-workers", str(decode), "--log-level", "warning",
             "--max-num-batched-tokens", str(STEP_TOKENS)]  # fmt: skip
    tokenizer = LocalTokenizer(model)
    rows = []
    with ServeProcess(serve, work / f"{layout}.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        for mix in args.mixes:
            flags, spec = MIXES[mix]
            alone = None
            if args.fit_interference and prefill:  # prefill steps with nothing decoding
                started = time.time()
                bench(server.url, model, flags, work / f"{layout}-{mix}-alone.json", [
                    "--num-prompts", str(args.calibration_prompts), "--random-output-len", "1",
                    "--max-concurrency", str(CALIBRATION_CONCURRENCY), "--seed", "98",
                ])  # fmt: skip
                alone = (started, time.time())
            handover_before = handover_buckets(server.url)
            calib = bench(server.url, model, flags, work / f"{layout}-{mix}-calib.json", [
                "--num-prompts", str(args.calibration_prompts),
                "--max-concurrency", str(CALIBRATION_CONCURRENCY), "--seed", "99",
            ])  # fmt: skip
            capacity = calib["request_throughput"]
            handover = bucket_median(handover_before, handover_buckets(server.url))
            open_loop = None
            if args.calibration_open_loop > 0:  # prompts arriving while others decode
                started = time.time()
                bench(server.url, model, flags, work / f"{layout}-{mix}-open.json", [
                    "--num-prompts", str(args.calibration_prompts), "--seed", "97",
                    "--request-rate", str(round(args.calibration_open_loop * capacity, 3)),
                ])  # fmt: skip
                open_loop = (started, time.time())
            reply = telemetry(server.url)
            (work / f"{layout}-{mix}-telemetry.json").write_text(json.dumps(reply))
            for fraction in args.loads:
                rate = round(fraction * capacity, 3)
                count = max(20, round(rate * args.duration))
                started = time.time()
                real = bench(server.url, model, flags, work / f"{layout}-{mix}-{fraction}.json", [
                    "--num-prompts", str(count), "--request-rate", str(rate),
                    "--seed", str(args.seed),
                ])  # fmt: skip
                window = (started, time.time())
                run_reply = telemetry(server.url)
                (work / f"{layout}-{mix}-{fraction}-telemetry.json").write_text(
                    json.dumps(run_reply)
                )
                measured = {
                    "layout": layout, "mix": mix, "load": fraction, "rate": rate, "count": count,
                    "capacity_req_s": capacity, "handover_ms": handover * 1e3, "alone": alone,
                    "open_loop": open_loop, "window": window,
                }  # fmt: skip
                row = simulate(measured, reply, run_reply, real, tokenizer, args)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def simulate(
    measured: dict,
    reply: dict,
    run_reply: dict,
    real: dict,
    tokenizer: LocalTokenizer,
    args: argparse.Namespace,
) -> dict:
    """One report row: the simulator on the very requests of a real run. `measured`: what the
    real side gave (layout, mix, load, rate, request count, capacity, handover, the calibration's
    `alone` window and the run's window); `reply`: the telemetry after the calibration run;
    `run_reply`: after the run; `real`: the run's bench record."""
    layout, mix, rate = measured["layout"], measured["mix"], measured["rate"]
    prefill, decode = LAYOUTS[layout]
    fit_reply, alone = fitted_steps(measured, reply, run_reply, args.fit_on, args.fit_open_loop)
    cal = calibrate(fit_reply, f"{layout}-{mix}", args.fit_interference, alone, args.fit_threads)
    costs = Costs(cal.model, by_threads=cal.by_threads)
    pools = pools_real(steps_of(run_reply), *measured["window"], costs)
    load = LoadConfig(request_rate=rate, seed=args.seed)
    spec = MIXES[mix][1]
    samples = sample_requests(DatasetConfig(spec, measured["count"], args.seed), tokenizer)
    requests = from_samples(samples, tokenizer.encode, load)
    handover = measured["handover_ms"] / 1e3 if args.handover else 0.0
    scenario = Scenario(
        Deployment(
            prefill,
            decode,
            EngineLimits(args.num_kv_blocks, max_num_batched_tokens=STEP_TOKENS),
            prefill_interference=simulated(cal.prefill_interference, args.interference),
            decode_interference=simulated(cal.decode_interference, args.interference),
            paced_cores=max(cal.by_threads) if cal.by_threads else None,
            step_noise=cal.step_noise if args.step_noise else (),
            prefill_step_noise=cal.prefill_step_noise if args.step_noise else (),
            thread_noise=cal.thread_noise if args.step_noise and args.noise_by_threads else {},
        ),
        costs,
        Overheads(step_gap=cal.step_gap, dispatch=args.dispatch_ms / 1e3, handover=handover),
    )
    # With step noise a simulation is one draw of many: each metric is the median over
    # --noise-runs of them (their first gives the pool shares).
    runs = args.noise_runs if args.step_noise else 1
    outcomes = [
        Simulation(scenario, requests, load, noise_seed=seed).run() for seed in range(1, runs + 1)
    ]
    compared = [compare(real, simulated_record(o, scenario, load), args) for o in outcomes]
    medians = {k: statistics.median(c[k] for c in compared) for k in compared[0]}
    for metric in TARGETS:  # errors of the medians
        medians[f"{metric}_err_pct"] = error_pct(
            medians[f"{metric}_real"], medians[f"{metric}_sim"]
        )
    medians["slo_diff_pts"] = (medians["slo_sim"] - medians["slo_real"]) * 100
    outcome = outcomes[0]
    return {**measured, "fitted_steps": cal.fitted, "noise_runs": runs,
            "fit_heldout_mae_pct": cal.model.stats.heldout_mae_pct,
            "step_gap_ms": cal.step_gap * 1e3,
            "prefill_interference": summary(cal.prefill_interference),
            "decode_interference": summary(cal.decode_interference),
            "step_noise": summary(cal.step_noise) if args.step_noise else None,
            "prefill_step_noise": summary(cal.prefill_step_noise) if args.step_noise else None,
            "thread_models": {t: {"steps": m.stats.num_train + m.stats.num_heldout,
                                  "heldout_mae_pct": m.stats.heldout_mae_pct}
                              for t, m in cal.by_threads.items()},
            # decode steps started beside a prefill step; prefill steps, seconds
            **{f"{k}_real": v for k, v in pools.items()},
            **{f"{k}_sim": v for k, v in pools_sim(outcome).items()},
            **medians}  # fmt: skip


def fitted_steps(
    measured: dict, reply: dict, run_reply: dict, fit_on: str, open_loop: bool
) -> tuple[dict, tuple[float, float] | None]:
    """The telemetry the step models are fitted on, and the `alone` window in it: the
    calibration's (`reply`), without its open-loop part unless `open_loop`; or with `fit_on`
    "run", the run's own steps (`run_reply` in the run's window: the simulator apart from the
    VM's drift), and no `alone` window."""
    if fit_on == "run":
        return in_window(run_reply, *measured["window"]), None
    alone = tuple(measured["alone"]) if measured.get("alone") else None
    if not open_loop and measured.get("open_loop"):
        return in_window(reply, 0.0, measured["open_loop"][0]), alone  # the closed loop's
    return reply, alone


def in_window(reply: dict, start: float, end: float) -> dict:
    """A telemetry reply cut to the steps that ended in [start, end]."""
    return {
        "workers": {
            worker: {"steps": [s for s in w.get("steps", []) if start <= s["end"] <= end]}
            for worker, w in reply["workers"].items()
        }
    }


def replay(args: argparse.Namespace) -> list[dict]:
    """The simulations of an earlier run again, against its saved real runs (its --work-dir):
    simulator changes and flags compared on the same measurements, with no serving."""
    earlier = json.loads(args.replay.read_text())
    if earlier["settings"].get("work_dir") in (None, "None"):
        raise SystemExit(f"{args.replay} was run without --work-dir: no saved runs to replay")
    work = Path(earlier["settings"]["work_dir"])
    tokenizer = LocalTokenizer(args.model)
    rows = []
    for old in earlier["rows"]:
        name, fraction = f"{old['layout']}-{old['mix']}", old["load"]
        reply = json.loads((work / f"{name}-telemetry.json").read_text())
        run_reply = json.loads((work / f"{name}-{fraction}-telemetry.json").read_text())
        real = json.loads((work / f"{name}-{fraction}.json").read_text())
        measured = dict(old)
        # Reports from before the request count and the run's window were kept in them:
        measured.setdefault("count", max(20, round(old["rate"] * earlier["settings"]["duration"])))
        if "window" not in measured:  # the run ended with its last step
            last = max(s["end"] for w in run_reply["workers"].values() for s in w["steps"])
            measured["window"] = (last - real["duration"], last)
        rows.append(simulate(measured, reply, run_reply, real, tokenizer, args))
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        "| layout | mix | load | TTFT p50 real/sim ms (err) | TTFT p99 (err) | "
        "ITL p50 (err) | ITL p99 (err) | SLO real/sim (pts) | decode beside prefill real/sim | "
        "decode on fewer threads real/sim | decode step ms real/sim (real/model) | "
        "prefill steps, s real/sim |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
            cells.append(
                f"{r[key + '_real']:.0f}/{r[key + '_sim']:.0f} ({r[key + '_err_pct']:+.0f}%)"
            )
        slo = f"{r['slo_real']:.0%}/{r['slo_sim']:.0%} ({r['slo_diff_pts']:+.1f})"
        beside_cell, fewer_cell = (
            "/".join(
                "-" if x is None else f"{x:.0%}" for x in (r.get(k + "_real"), r.get(k + "_sim"))
            )
            for k in ("decode_beside", "decode_fewer_threads")
        )
        step_cell = "-"
        if r.get("decode_step_ms_real") is not None:
            step_cell = (
                f"{r['decode_step_ms_real']:.1f}/{r['decode_step_ms_sim']:.1f} "
                f"({r['decode_vs_model_real']:.2f}x)"
            )
        prefill_cell = "-"
        if r.get("prefill_steps_real") is not None:
            prefill_cell = (
                f"{r['prefill_steps_real']}, {r['prefill_seconds_real']:.1f}/"
                f"{r['prefill_steps_sim']}, {r['prefill_seconds_sim']:.1f}"
            )
        lines.append(
            f"| {r['layout']} | {r['mix']} | {r['load']:.0%} | {' | '.join(cells)} | {slo} | "
            f"{beside_cell} | {fewer_cell} | {step_cell} | {prefill_cell} |"
        )
    met = {
        key: sum(abs(r[key + "_err_pct"]) <= limit for r in rows) for key, limit in TARGETS.items()
    }
    met["slo"] = sum(abs(r["slo_diff_pts"]) <= 2 for r in rows)
    lines.append("")
    lines.append("within target: " + ", ".join(f"{k} {v}/{len(rows)}" for k, v in met.items()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument(
        "--layouts", nargs="+", choices=list(LAYOUTS), default=["colocated", "1P1D", "2P1D"]
    )
    p.add_argument("--mixes", nargs="+", choices=list(MIXES), default=["short"])
    p.add_argument("--loads", nargs="+", type=float, default=[0.3, 0.6, 0.9])
    p.add_argument(
        "--duration",
        type=float,
        default=90.0,
        help="seconds of arrivals per load (30 s rows hold 20-53 requests on this VM: too few "
        "for a p99, and their simulated p50 moves by more than 10%% between noise seeds)",
    )
    p.add_argument("--calibration-prompts", type=int, default=48)
    p.add_argument(
        "--calibration-open-loop",
        type=float,
        default=0.9,
        metavar="FRACTION",
        help="after the closed-loop calibration, send as many prompts again with Poisson arrivals "
        "at this fraction of the capacity it measured, and fit on both: waves of a closed loop "
        "prefill while nothing decodes, arrivals spread out prefill beside decode steps, as the "
        "loads do (0: off)",
    )
    p.add_argument(
        "--fit-open-loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fit on the open-loop calibration's steps too (--no-fit-open-loop with --replay: "
        "the closed-loop calibration alone, on the same real runs)",
    )
    p.add_argument("--num-kv-blocks", type=int, default=2912, help="what 1 GiB holds of SmolLM2")
    p.add_argument("--dispatch-ms", type=float, default=2.0, help="HTTP + tokenize + route")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fit-interference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fit prefill steps on a run where nothing decodes and decode steps on those beside "
        "no prefill step, and simulate each kind beside the other as slowed by its measured "
        "factor (--no-fit-interference: one model fitted on every step, no interference)",
    )
    p.add_argument(
        "--fit-threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when the workers paced their cores (steps on different thread counts), fit a "
        "model per thread count and simulate the pacing, with no interference factor",
    )
    p.add_argument(
        "--step-noise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each simulated step draws one of the fitted steps' times over the model's (the "
        "spread a deterministic model lacks: the ITL tail); --no-step-noise: the model's time",
    )
    p.add_argument(
        "--noise-by-threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --step-noise on paced workers: each step draws from the spread measured on "
        f"its thread count (a kind with fewer than {MIN_THREAD_NOISE} such steps: from all of "
        "its kind)",
    )
    p.add_argument(
        "--fit-on",
        choices=("calibration", "run"),
        default="calibration",
        help="fit the step models on the calibration run before the loads (what a user has), or "
        "on each load run's own steps (the simulator's error apart from the machine's drift "
        "between runs: the report's real/model column)",
    )
    p.add_argument(
        "--noise-runs",
        type=int,
        default=5,
        help="with --step-noise: simulations per run (seeds 1..N); each metric is their median",
    )
    p.add_argument(
        "--interference",
        choices=("median", "mean", "draw"),
        default="median",
        help="what a slowed step takes of the slowdowns measured: their median, their mean, or "
        "one drawn from them all",
    )
    p.add_argument(
        "--handover",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="simulate the handover measured in the calibration run (disaggregated layouts)",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--replay",
        type=Path,
        default=None,
        metavar="JSON",
        help="simulate again against the real runs of an earlier --json report (it needs its "
        "--work-dir): no serving, the same measurements",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep the runs' files here (bench results, server logs, each run's telemetry)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.noise_runs < 1:
        raise SystemExit("--noise-runs must be at least 1")
    if args.model is None:
        from engine.fetch import fetch_default_model

        args.model = fetch_default_model()
    rows = replay(args) if args.replay is not None else serve_and_simulate(args)
    print(format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"settings": vars(args), "rows": rows}, indent=2, default=str)
        )
    return 0


def serve_and_simulate(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tandem-fidelity-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for layout in args.layouts:
            rows += run_layout(args.model, layout, args, work)
    return rows


if __name__ == "__main__":
    sys.exit(main())
