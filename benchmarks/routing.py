"""KV-aware routing: prefix hit rate and TTFT of each routing policy on a prefix-repetition load.

    python benchmarks/routing.py [--model DIR] [--mode colocated|disaggregated] [--rounds 1] \
        [--num-prompts 64] [--concurrency 8] [--json results/routing.json]

For each policy `tandem serve` runs 2 colocated workers (`--mode colocated`, the default) or 1
prefill and 2 decode workers (`--mode disaggregated`), prefix caching on, with `--routing
POLICY`, and `tandem bench` (its own client, run as a user would) sends the `prefix_repetition`
dataset: a few long shared prefixes, each request one of them plus its own suffix. Rounds
interleave the policies (A B C A B C). Reported per policy, medians over rounds: prompt tokens
served from a prefix cache (every worker's tandem:prefix_cache_hits over its queries, read from
/metrics), TTFT p50/p99, output tok/s, and the requests decode workers prefilled themselves
(disaggregated mode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.serve_process import ServeProcess  # noqa: E402

POLICIES = ("cost", "load", "round-robin")
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
COUNTERS = (
    "tandem:prefix_cache_hits",
    "tandem:prefix_cache_queries",
    "tandem:requests_prefilled_locally",
)


def counters(metrics_text: str) -> dict[str, float]:
    """Each counter of COUNTERS summed over the workers."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals and sample.name.endswith("_total"):
                totals[name] += sample.value
    return totals


def bench_args(url: str, model: Path, args: argparse.Namespace, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "cli.main", "bench", "--base-url", url, "--model", model.name,
        "--tokenizer", str(model), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-num-prefixes", str(args.num_prefixes),
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", str(args.seed), "--disable-tqdm",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


def run_policy(model: Path, policy: str, args: argparse.Namespace, work: Path, n: int) -> dict:
    prefill_workers = "1" if args.mode == "disaggregated" else "0"
    serve = ["--model", str(model), "--mode", args.mode, "--prefill-workers", prefill_workers,
             "--decode-workers", "2", "--routing", policy, "--dtype", args.dtype,
             "--log-level", "warning"]  # fmt: skip
    out = work / f"{policy}-{n}.json"
    with ServeProcess(serve, work / f"{policy}-{n}.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        with open(work / f"{policy}-{n}.bench.txt", "w") as report:
            command = bench_args(server.url, model, args, out)
            done = subprocess.run(command, cwd=ROOT, stdout=report, check=False)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10, trust_env=False).text
        server.stop(STOP_TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"tandem bench failed for {policy} (exit {done.returncode})")
    result = json.loads(out.read_text())
    totals = counters(metrics)
    queries = totals["tandem:prefix_cache_queries"]
    return {
        "hit_rate": totals["tandem:prefix_cache_hits"] / queries if queries else 0.0,
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "output_tok_s": result["output_throughput"],
        "local_prefills": totals["tandem:requests_prefilled_locally"],
        "completed": result["completed"],
    }


def summarize(runs: list[dict]) -> dict:
    keys = runs[0].keys()
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"rounds": len(runs)}


def format_table(rows: dict[str, dict]) -> str:
    head = "| policy | prefix hit rate | TTFT p50 ms | TTFT p99 ms | out tok/s | local prefills |"
    lines = [head, "|---|---|---|---|---|---|"]
    for policy, r in rows.items():
        lines.append(
            f"| {policy} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} "
            f"| {r['output_tok_s']:.1f} | {r['local_prefills']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--mode", choices=("disaggregated", "colocated"), default="colocated",
                   help="2 colocated workers, or 1 prefill and 2 decode workers")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from engine.fetch import fetch_default_model

        args.model = fetch_default_model()
    runs: dict[str, list[dict]] = {p: [] for p in args.policies}
    with tempfile.TemporaryDirectory(prefix="tandem-routing-") as tmp:
        for n in range(args.rounds):
            for policy in args.policies:
                runs[policy].append(run_policy(args.model, policy, args, Path(tmp), n))
                print(f"round {n + 1} {policy}: {runs[policy][-1]}", file=sys.stderr)
    rows = {p: summarize(r) for p, r in runs.items()}
    print(format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"settings": vars(args), "rows": rows, "runs": runs}
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
