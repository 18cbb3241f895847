"""KV handover latency and the KV checksum's cost, served (`tandem serve`, 1 prefill + 1 decode
worker), one request at a time so nothing queues:

    python benchmarks/handover.py [--prompt-tokens 1000 4000] [--requests 6] [--rounds 2] \
        [--model DIR] [--kv-transport gloo] [--json results/handover.json]

Per prompt length and setting (`--kv-checksum` on, then off, in interleaved rounds):

- TTFT at the client (p50): the checksum's cost is on / off - 1;
- handover (p50, from `tandem:kv_handover_seconds`): the prefill step's end on the prefill
  worker to the first token reaching the HTTP layer;
- exposed transfer (p50, `tandem:kv_transfer_exposed_seconds`): the part of the layer-pipelined
  KV transfer that comes after the prefill step ended, and the whole transfer
  (`tandem:kv_transfer_seconds`, the prefill worker's).

Handover minus exposed transfer is what the handover costs beyond the bytes (the result's way
back to the coordinator, dispatch); the target is at most 5 ms at p50. Percentiles from
histograms are interpolated within their bucket, as Prometheus' histogram_quantile does.
Prompts are random token ids (a fixed seed, none shared, prefix caching off), 2 tokens out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.serve_process import ServeProcess  # noqa: E402

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
HISTOGRAMS = {
    "handover": ("tandem:kv_handover_seconds", None),
    "exposed": ("tandem:kv_transfer_exposed_seconds", "prefill"),
    "transfer": ("tandem:kv_transfer_seconds", "prefill"),
}


def main() -> None:
    args = parse_args()
    model = Path(args.model).expanduser()
    rows: dict[tuple[int, bool], list[dict]] = {}
    with tempfile.TemporaryDirectory() as work:
        for round_index in range(args.rounds):
            for checksum in (True, False):
                label = "on" if checksum else "off"
                print(f"--- round {round_index + 1}/{args.rounds}, checksum {label}", flush=True)
                for length, measured in serve_and_measure(model, checksum, args, Path(work)):
                    rows.setdefault((length, checksum), []).append(measured)
                    print(f"  {length} tokens: {format_row(measured)}", flush=True)
    summary = summarize(rows)
    print_table(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": summary}, indent=2))
        print(f"wrote {args.json}")


def serve_and_measure(
    model: Path, checksum: bool, args: argparse.Namespace, work: Path
) -> list[tuple[int, dict]]:
    flags = [
        "--model", str(model), "--mode", "disaggregated", "--prefill-workers", "1",
        "--decode-workers", "1", "--no-prefix-caching", "--kv-transport", args.kv_transport,
        "--kv-checksum" if checksum else "--no-kv-checksum", "--log-level", "warning",
        "--max-model-len", str(max(args.prompt_tokens) + 16),
    ]  # fmt: skip
    log = work / f"serve-{'on' if checksum else 'off'}.log"
    results = []
    with ServeProcess(flags, log) as server, httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        server.wait_healthy(START_TIMEOUT_S)
        model_id = http.get(server.url + "/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        send(http, server.url, model_id, [rng.randrange(1000, 20000) for _ in range(64)])  # warm
        for length in args.prompt_tokens:
            before = histograms(http.get(server.url + "/metrics").text)
            ttfts = []
            for _ in range(args.requests):
                prompt = [rng.randrange(1000, 20000) for _ in range(length)]
                ttfts.append(send(http, server.url, model_id, prompt))
            after = histograms(http.get(server.url + "/metrics").text)
            measured = {"ttft_p50_ms": 1000 * statistics.median(ttfts)}
            for name in HISTOGRAMS:
                delta = difference(after[name], before[name])
                measured[f"{name}_p50_ms"] = 1000 * quantile(delta, 0.5)
                measured[f"{name}_mean_ms"] = 1000 * delta["sum"] / max(delta["count"], 1)
            results.append((length, measured))
        server.stop(30.0)
    return results


def send(http: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending to the first streamed chunk that carries a choice."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started = time.perf_counter()
    first = None
    with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"choices":[{' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first


def histograms(text: str) -> dict[str, dict]:
    """Each histogram of HISTOGRAMS as {"buckets": [(bound, cumulative)], "sum", "count"}."""
    found = {name: {"buckets": {}, "sum": 0.0, "count": 0.0} for name in HISTOGRAMS}
    wanted = {metric: (name, pool) for name, (metric, pool) in HISTOGRAMS.items()}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        name, pool = wanted[family.name]
        for sample in family.samples:
            if pool is not None and sample.labels.get("pool") != pool:
                continue
            into = found[name]
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                into["buckets"][bound] = into["buckets"].get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                into["sum"] += sample.value
            elif sample.name.endswith("_count"):
                into["count"] += sample.value
    return found


def difference(after: dict, before: dict) -> dict:
    buckets = {b: n - before["buckets"].get(b, 0.0) for b, n in after["buckets"].items()}
    return {
        "buckets": buckets,
        "sum": after["sum"] - before["sum"],
        "count": after["count"] - before["count"],
    }


def quantile(histogram: dict, q: float) -> float:
    """Linear interpolation inside the bucket that holds the q-th observation."""
    total = histogram["count"]
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in sorted(histogram["buckets"].items()):
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, cumulative
    return lower


def summarize(rows: dict[tuple[int, bool], list[dict]]) -> list[dict]:
    summary = []
    for (length, checksum), measured in sorted(rows.items()):
        keys = measured[0].keys()
        row = {key: statistics.median(m[key] for m in measured) for key in keys}
        summary.append({"prompt_tokens": length, "checksum": checksum, **row})
    for row in summary:
        if row["checksum"]:
            off = next(
                r
                for r in summary
                if r["prompt_tokens"] == row["prompt_tokens"] and not r["checksum"]
            )
            row["checksum_cost"] = row["ttft_p50_ms"] / off["ttft_p50_ms"] - 1
    return summary


def format_row(m: dict) -> str:
    return (f"TTFT p50 {m['ttft_p50_ms']:.1f} ms, handover p50 {m['handover_p50_ms']:.2f} ms, "
            f"exposed transfer p50 {m['exposed_p50_ms']:.2f} ms, transfer p50 "
            f"{m['transfer_p50_ms']:.2f} ms")  # fmt: skip


def print_table(summary: list[dict]) -> None:
    print()
    header = ("tokens", "checksum", "TTFT p50", "handover p50", "exposed p50", "transfer p50",
              "handover - exposed", "checksum cost")  # fmt: skip
    print(" | ".join(f"{h:>12}" for h in header))
    for row in summary:
        cost = f"{100 * row['checksum_cost']:+.1f}%" if "checksum_cost" in row else "-"
        cells = (row["prompt_tokens"], "on" if row["checksum"] else "off",
                 f"{row['ttft_p50_ms']:.1f}", f"{row['handover_p50_ms']:.2f}",
                 f"{row['exposed_p50_ms']:.2f}", f"{row['transfer_p50_ms']:.2f}",
                 f"{row['handover_p50_ms'] - row['exposed_p50_ms']:.2f}", cost)  # fmt: skip
        print(" | ".join(f"{c!s:>12}" for c in cells))
    print("times in ms; p50s of histograms are interpolated within their bucket")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="~/.cache/tandem/models/SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--requests", type=int, default=6, help="per length, server and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-transport", default="gloo")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be at least 1")
    return args


if __name__ == "__main__":
    main()
