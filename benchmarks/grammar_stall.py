"""What one request with a large response format costs the streams beside it, served.

    python benchmarks/grammar_stall.py [--model DIR] [--streams 8] [--depth 21] [--width 20] \
        [--targets colocated 1p1d] [--json results/grammar_stall.json]

Starts `tandem serve` (one colocated worker, or 1P1D), streams `--streams` plain completions
(greedy, ignore-eos, 256 tokens), and a second later sends one completion held to a JSON schema
of `--depth` nested objects of `--width` patterned strings each (21 x 20: 24 KB, inside the
64 KiB and nesting limits; about 6 s to compile on one core here, 21 x 40 about 13 s).

Reported per target: the plain streams' longest gap between two tokens until the structured
request's first token (its grammar compiles then) and until its end (its decode steps fill its
token mask too), their ITL p50/p99 over the whole run, and the structured request's time to
its first token and to its end. When the compile ran on the engine thread, every plain stream
stopped for as long as it took. `--warm` first sends a small structured request, so that the
compiler's one-time set-up (reading the tokenizer's vocabulary) is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.serve_process import ServeProcess  # noqa: E402

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
TARGETS = {
    "colocated": ("--mode", "colocated", "--prefill-workers", "0", "--decode-workers", "1"),
    "1p1d": ("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1"),
}
PLAIN_TOKENS = 256


def nested_schema(depth: int, width: int) -> dict:
    schema: dict = {"type": "string", "pattern": "[a-z]{2,8}"}
    for level in range(depth):
        properties = {
            f"p{level}_{j}": {"type": "string", "pattern": f"[a-z]{{{j % 5 + 1},{j % 5 + 6}}}"}
            for j in range(width)
        }
        properties[f"k{level}"] = schema
        schema = {"type": "object", "properties": properties, "required": [f"k{level}"]}
    return schema


async def plain_stream(http: httpx.AsyncClient, model: str, index: int) -> list[float]:
    """The arrival time of each token of one streamed completion."""
    body = {"model": model, "prompt": f"Story number {index}: once upon a time",
            "max_tokens": PLAIN_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    times = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            data = line.removeprefix("data: ")
            if data != line and data != "[DONE]" and json.loads(data)["choices"][0]["text"]:
                times.append(time.monotonic())
    return times


async def structured_request(http: httpx.AsyncClient, model: str, schema: dict) -> dict:
    body = {"model": model, "prompt": "A JSON object:", "max_tokens": 32, "temperature": 0,
            "stream": True, "response_format": {"type": "json_schema",
            "json_schema": {"name": "nested", "schema": schema}}}  # fmt: skip
    sent, first, status = time.monotonic(), None, None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.monotonic()
    done = time.monotonic()
    return {"sent": sent, "first": first, "done": done, "status": status}


async def one_run(url: str, model: str, streams: int, schema: dict, warm: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        if warm:  # the grammar compiler's one-time set-up (the tokenizer's vocabulary) first
            await structured_request(http, model, {"type": "string"})
        plain = [asyncio.create_task(plain_stream(http, model, i)) for i in range(streams)]
        await asyncio.sleep(1.0)
        structured = await structured_request(http, model, schema)
        token_times = await asyncio.gather(*plain)
    start, first, done = structured["sent"], structured["first"], structured["done"]
    pairs = [(a, b) for times in token_times for a, b in zip(times, times[1:], strict=False)]
    gaps = [b - a for a, b in pairs]
    before_first = [b - a for a, b in pairs if b >= start and a <= (first or done)]
    while_running = [b - a for a, b in pairs if b >= start and a <= done]
    gaps.sort()
    return {
        "structured_status": structured["status"],
        "structured_first_token_s": None if first is None else first - start,
        "structured_total_s": done - start,
        "plain_longest_gap_before_its_first_token_s": max(before_first, default=0.0),
        "plain_longest_gap_while_it_ran_s": max(while_running, default=0.0),
        "plain_itl_p50_ms": 1e3 * statistics.median(gaps),
        "plain_itl_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "plain_tokens": sum(len(t) for t in token_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=str(Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct")
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--depth", type=int, default=21)
    parser.add_argument("--width", type=int, default=20)
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=["colocated"])
    parser.add_argument(
        "--warm",
        action="store_true",
        help="send a small structured request first (the compiler's set-up)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    schema = nested_schema(args.depth, args.width)
    results = {}
    for target in args.targets:
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "serve.log"
            serve_args = ["--model", args.model, "--served-model-name", "m", *TARGETS[target]]
            with ServeProcess(serve_args, log) as server:
                server.wait_healthy(START_TIMEOUT_S)
                results[target] = asyncio.run(
                    one_run(server.url, "m", args.streams, schema, args.warm)
                )
                server.stop(60)
    print(f"schema: {args.depth} nested objects x {args.width} strings, "
          f"{len(json.dumps(schema)):,} bytes; {args.streams} plain streams beside it")  # fmt: skip
    header = ("target", "status", "its TTFT s", "its total s", "plain max gap: to its TTFT s",
              "to its end s", "plain ITL p50 ms", "p99 ms")  # fmt: skip
    print(" | ".join(header))
    for target, r in results.items():
        ttft = r["structured_first_token_s"]
        print(" | ".join([
            target, str(r["structured_status"]), "-" if ttft is None else f"{ttft:.2f}",
            f"{r['structured_total_s']:.2f}",
            f"{r['plain_longest_gap_before_its_first_token_s']:.2f}",
            f"{r['plain_longest_gap_while_it_ran_s']:.2f}",
            f"{r['plain_itl_p50_ms']:.1f}", f"{r['plain_itl_p99_ms']:.1f}",
        ]))  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"schema_bytes": len(json.dumps(schema)), **results}))


if __name__ == "__main__":
    main()
