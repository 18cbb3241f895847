"""Does `tandem plan` pick the layout that serves best? Its pick against every layout, measured.

    python benchmarks/plan_check.py [--gpus 3] [--mixes chat summarize generate] \
        [--duration 60] [--profile FILE] [--json results/plan-check.json]

Per workload mix (a dataset and a Poisson rate):
  1. `tandem plan --gpus G` on the workload (a fresh `tandem profile --threads 1` of the model,
     unless --profile names one): every split of G single-thread workers simulated, its
     predicted goodput, and its pick;
  2. every one of those layouts served for real (`tandem serve --threads-per-worker 1`), and
     `tandem bench` sending the very same requests (same dataset flags, tokenizer, seed and
     arrival times) with `--goodput` set from the same SLO.
Reported per mix: predicted and measured goodput of each layout, the pick, the measured best,
and the pick's measured goodput as a share of the best. Target (issue 17): the pick is the
measured best or within 5% of its goodput, on at least three mixes.

On the 2-core development VM, G = 3 single-thread workers share two cores (the issue asks for
3-4 single-thread workers). The profile is measured on one thread with the machine otherwise
idle, and the plan is told how many cores the workers share (`--host-cores`, default: this
machine's), so it prices a step slower while more workers than cores are stepping.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from simulator_fidelity import START_TIMEOUT_S, bench  # noqa: E402

from loadtest.serve_process import ServeProcess  # noqa: E402

MIXES = {  # name: (dataset flags, request rate); lengths in tokens, rates in requests a second
    "chat": (["--dataset-name", "random", "--random-input-len", "200",
              "--random-output-len", "100", "--random-range-ratio", "0.5"], 4.0),
    "summarize": (["--dataset-name", "random", "--random-input-len", "1000",
                   "--random-output-len", "16", "--random-range-ratio", "0.3"], 2.0),
    "generate": (["--dataset-name", "random", "--random-input-len", "50",
                  "--random-output-len", "300", "--random-range-ratio", "0.3"], 2.2),
}  # fmt: skip
TARGET_SHARE = 0.95


def layouts(gpus: int) -> list[tuple[int, int]]:
    """(prefill, decode) workers of every layout `tandem plan` tries: all colocated, then P+D."""
    return [(0, gpus), *((p, gpus - p) for p in range(1, gpus))]


def layout_name(prefill: int, decode: int) -> str:
    return f"{decode} colocated" if prefill == 0 else f"{prefill}P{decode}D"  # as plan names it


def load_flags(mix: str, args: argparse.Namespace) -> list[str]:
    """How many requests of the mix, at what Poisson rate, from which seed."""
    rate = MIXES[mix][1]
    count = max(20, round(rate * args.duration))
    return ["--num-prompts", str(count), "--request-rate", str(rate), "--seed", str(args.seed)]


def workload_flags(mix: str, args: argparse.Namespace) -> list[str]:
    return [*MIXES[mix][0], *load_flags(mix, args)]


def goodput_flags(args: argparse.Namespace) -> list[str]:
    return ["--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.itl_ms:g}"]


def plan(mix: str, profile: Path, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"plan-{mix}.json"
    command = [
        sys.executable, "-m", "cli.main", "plan", "--gpus", str(args.gpus),
        "--slo", f"ttft_p99={args.ttft_ms:g}ms,itl_p99={args.itl_ms:g}ms",
        "--profile", str(profile), "--model-dir", str(args.model),
        "--tokenizer", str(args.model), "--model", args.model.name,
        "--host-cores", str(args.host_cores), "--step-gap-ms", str(args.step_gap_ms),
        "--dispatch-ms", str(args.dispatch_ms),
        *workload_flags(mix, args), "--plan-json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    (work / f"plan-{mix}.txt").write_text(done.stdout + done.stderr)
    if done.returncode not in (0, 3):  # 3: no layout meets the SLO (the plan says so)
        raise SystemExit(f"tandem plan failed (exit {done.returncode}):\n{done.stderr}")
    print(done.stdout, file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def profile_model(args: argparse.Namespace, work: Path) -> Path:
    if args.profile is not None:
        return args.profile
    out = work / "profile-1thread.json"
    command = [sys.executable, "-m", "cli.main", "profile", "--model", str(args.model),
               "--threads", "1", "--max-batch", "64", "--output", str(out)]  # fmt: skip
    print("profiling the model on one thread ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tandem profile failed (exit {done.returncode}):\n{done.stderr}")
    return out


def measure(prefill: int, decode: int, args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """Each mix's bench record on one served layout."""
    name = layout_name(prefill, decode)
    mode = "colocated" if prefill == 0 else "disaggregated"
    serve = ["--model", str(args.model), "--mode", mode, "--prefill-workers", str(prefill),
             "--decode-workers", str(decode), "--threads-per-worker", "1",
             "--log-level", "warning"]  # fmt: skip
    records = {}
    with ServeProcess(serve, work / f"{name}.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        for mix in args.mixes:
            extra = [*load_flags(mix, args), *goodput_flags(args)]
            out = work / f"{name}-{mix}.json"
            records[mix] = bench(server.url, args.model, MIXES[mix][0], out, extra)
            r = records[mix]
            print(f"  {name} {mix}: goodput {r.get('request_goodput')} req/s, "
                  f"TTFT p99 {r['p99_ttft_ms']:.0f} ms, ITL p99 {r['p99_itl_ms']:.0f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
    return records


def compare(mix: str, planned: dict, measured: dict[str, dict]) -> dict:
    rows = []
    predicted = {c["layout"]: c for c in planned["candidates"]}
    for name, record in measured.items():
        c = predicted[name]
        rows.append({
            "layout": name,
            "predicted_goodput": c["goodput"],
            "predicted_feasible": c["feasible"],
            "predicted_ms": c["predicted_ms"],
            "measured_goodput": record.get("request_goodput") or 0.0,
            "measured_ttft_p99_ms": record["p99_ttft_ms"],
            "measured_itl_p99_ms": record["p99_itl_ms"],
            "measured_throughput": record["request_throughput"],
        })  # fmt: skip
    best = max(rows, key=lambda r: r["measured_goodput"])
    pick = None if planned["best"] is None else planned["best"]["layout"]
    picked = next((r for r in rows if r["layout"] == pick), None)
    share = picked["measured_goodput"] / best["measured_goodput"] if picked and best[
        "measured_goodput"] else 0.0  # fmt: skip
    return {"mix": mix, "rate": MIXES[mix][1], "pick": pick, "measured_best": best["layout"],
            "pick_share_of_best": share, "met": share >= TARGET_SHARE, "layouts": rows}  # fmt: skip


def format_table(results: list[dict]) -> str:
    lines = ["| mix | rate req/s | layout | predicted goodput | measured goodput | "
             "measured TTFT p99 / ITL p99 ms |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        for row in r["layouts"]:
            mark = (" (pick)" if row["layout"] == r["pick"] else "") + (
                " (best)" if row["layout"] == r["measured_best"] else "")  # fmt: skip
            lines.append(
                f"| {r['mix']} | {r['rate']:g} | {row['layout']}{mark} | "
                f"{row['predicted_goodput']:.2f}{'' if row['predicted_feasible'] else ' (miss)'} | "
                f"{row['measured_goodput']:.2f} | "
                f"{row['measured_ttft_p99_ms']:.0f} / {row['measured_itl_p99_ms']:.0f} |"
            )
    lines.append("")
    for r in results:
        lines.append(f"{r['mix']}: pick {r['pick']}, measured best {r['measured_best']}, pick's "
                     f"goodput {r['pick_share_of_best']:.0%} of the best "
                     f"({'met' if r['met'] else 'missed'})")  # fmt: skip
    met = sum(r["met"] for r in results)
    lines.append(f"pick within {1 - TARGET_SHARE:.0%} of the measured best: {met}/{len(results)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--profile", type=Path, default=None, help="default: profile it now")
    p.add_argument("--gpus", type=int, default=3, help="single-thread workers to split")
    p.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per mix")
    p.add_argument("--ttft-ms", type=float, default=2000.0, help="TTFT p99 objective")
    p.add_argument("--itl-ms", type=float, default=150.0, help="ITL p99 (and TPOT) objective")
    p.add_argument(
        "--host-cores", type=float, default=float(os.cpu_count() or 1), help="cores workers share"
    )
    p.add_argument("--step-gap-ms", type=float, default=1.0, help="the plan's host time per step")
    p.add_argument("--dispatch-ms", type=float, default=2.0, help="the plan's HTTP + routing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan-only", action="store_true", help="print the plans, serve nothing")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from engine.fetch import fetch_default_model

        args.model = fetch_default_model()
    with tempfile.TemporaryDirectory(prefix="tandem-plan-check-") as tmp:
        work = Path(tmp)
        profile = profile_model(args, work)
        plans = {mix: plan(mix, profile, args, work) for mix in args.mixes}
        if args.plan_only:
            return 0
        measured: dict[str, dict[str, dict]] = {mix: {} for mix in args.mixes}
        for prefill, decode in layouts(args.gpus):
            for mix, record in measure(prefill, decode, args, work).items():
                measured[mix][layout_name(prefill, decode)] = record
    results = [compare(mix, plans[mix], measured[mix]) for mix in args.mixes]
    print(format_table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"settings": vars(args), "results": results}, indent=2, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
