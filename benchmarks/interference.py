"""Prefill/decode interference: tandem colocated vs disaggregated on the same two workers, under
the `mixed` workload (mostly short prompts, some long ones), measured over HTTP.

    python benchmarks/interference.py [--model DIR] [--num-prompts 24] [--request-rate 0.4] \
        [--short-len 64] [--long-len 1024] [--long-fraction 0.25] [--output-len 64] \
        [--slo-ttft-ms 4000] [--slo-tpot-ms 250] [--json results/interference.json]

colocated: two workers that each prefill and decode. disaggregated: one prefill worker and one
decode worker. Each layout gets its own `tandem serve` (prefix caching off, so every prefill is
real), then `tandem bench` sends both the same prompts at the same arrival times (same seed,
Poisson arrivals, EOS ignored). A request is good when it meets both SLOs. One server runs at a
time, so the two layouts never share the machine with each other.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli import main as cli  # noqa: E402
from loadtest.compare import compare_table  # noqa: E402
from loadtest.results import Record, load_record  # noqa: E402
from loadtest.serve_process import ServeProcess  # noqa: E402

WORKERS = ("--prefill-workers", "1", "--decode-workers", "1")  # colocated places 1 + 1 = 2
LAYOUTS = {
    "colocated": ("--mode", "colocated", *WORKERS),
    "disaggregated": ("--mode", "disaggregated", *WORKERS),
}
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
COLUMNS = (  # (record key, heading)
    ("median_ttft_ms", "p50 TTFT ms"),
    ("p99_ttft_ms", "p99 TTFT ms"),
    ("median_itl_ms", "p50 ITL ms"),
    ("p99_itl_ms", "p99 ITL ms"),
    ("median_tpot_ms", "p50 TPOT ms"),
    ("request_goodput", "goodput req/s"),
    ("output_throughput", "out tok/s"),
)


def serve_args(args: argparse.Namespace) -> list[str]:
    model = ["--model", str(args.model)] if args.model else []
    return [*model, "--no-prefix-caching", "--kv-cache-memory", args.kv_cache_memory,
            "--log-level", "warning"]  # fmt: skip


def bench_args(args: argparse.Namespace, url: str, tokenizer: Path, saved: Path) -> list[str]:
    return [
        "bench", "--base-url", url, "--tokenizer", str(tokenizer), "--dataset-name", "mixed",
        "--mixed-short-len", str(args.short_len), "--mixed-long-len", str(args.long_len),
        "--mixed-long-fraction", str(args.long_fraction),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--ignore-eos",
        "--temperature", "0",
        "--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}",
        "--disable-tqdm", "--result-path", str(saved), "--label", saved.stem,
    ]  # fmt: skip


def measure_layout(name: str, args: argparse.Namespace, tokenizer: Path, work: Path) -> Record:
    """Starts the layout's server, benchmarks it, stops it; returns the saved result."""
    saved = work / f"{name}.json"
    with ServeProcess([*serve_args(args), *LAYOUTS[name]], work / f"{name}.log") as server:
        print(f"--- {name}: starting tandem serve {' '.join(LAYOUTS[name])}", flush=True)
        server.wait_healthy(START_TIMEOUT_S)
        status = cli.main(bench_args(args, server.url, tokenizer, saved))
        if server.stop(STOP_TIMEOUT_S) != 0:
            print(f"warning: {name} server did not exit cleanly:\n{server.log}", file=sys.stderr)
    if status != 0:
        raise SystemExit(f"tandem bench against {name} failed (exit {status})")
    return load_record(saved)


def summary(record: Record, num_prompts: int) -> dict[str, float | int]:
    row: dict[str, float | int] = {key: record[key] for key, _ in COLUMNS}
    row["completed"], row["failed"] = record["completed"], record["failed"]
    row["good_fraction"] = record["request_goodput"] * record["duration"] / num_prompts
    row["duration_s"] = record["duration"]
    return row


def workload(args: argparse.Namespace) -> str:
    return (
        f"{args.num_prompts} requests, {args.long_fraction:.0%} of {args.long_len} tokens, "
        f"else {args.short_len}; {args.output_len} out; {args.request_rate:g} req/s Poisson; "
        f"SLO TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms"
    )


def format_table(rows: dict[str, dict[str, float | int]]) -> str:
    table = [["layout", *(heading for _, heading in COLUMNS), "good %"]]
    for name, row in rows.items():
        cells = [f"{row[key]:.2f}" for key, _ in COLUMNS] + [f"{100 * row['good_fraction']:.0f}"]
        table.append([name, *cells])
    widths = [max(len(cell) for cell in column) for column in zip(*table, strict=True)]
    return "\n".join(
        " | ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True))
        for cells in table
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--request-rate", type=float, default=0.4, help="req/s, Poisson")
    p.add_argument("--short-len", type=int, default=64, help="short prompt tokens")
    p.add_argument("--long-len", type=int, default=1024, help="long prompt tokens")
    p.add_argument("--long-fraction", type=float, default=0.25, help="share of long prompts")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0, help="goodput: TTFT at most")
    p.add_argument("--slo-tpot-ms", type=float, default=250.0, help="goodput: TPOT at most")
    p.add_argument("--kv-cache-memory", default="512MiB", help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=ROOT / "results" / "interference.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from engine.fetch import fetch_default_model

    tokenizer = args.model or fetch_default_model()
    with tempfile.TemporaryDirectory(prefix="interference-") as tmp:
        records = {name: measure_layout(name, args, tokenizer, Path(tmp)) for name in LAYOUTS}
    rows = {name: summary(record, args.num_prompts) for name, record in records.items()}
    print(f"\n=== {workload(args)} ===\n{format_table(rows)}")
    print("\n" + compare_table(records))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.json.write_text(json.dumps({"settings": settings, "layouts": rows}, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
