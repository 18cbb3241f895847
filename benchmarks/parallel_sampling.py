"""Prompts shared by requests that arrive together: computed once (`--share-prefill`, the
default) or by each request (`--no-share-prefill`), in-process and served.

    python benchmarks/parallel_sampling.py [--model DIR] [--prompts 8] [--n 4] \
        [--prompt-len 512] [--shared-len 448] [--output-len 32] [--rounds 2] \
        [--json results/parallel_sampling.json]

Two workloads, all requests at once, greedy, EOS ignored:
- `n`: --prompts random prompts, each asked for --n choices (one request with `n` served; n
  copies in-process, as the coordinator fans a request out);
- `system`: --prompts x --n requests of one --shared-len-token system prompt followed by a
  question of their own (prompt-len - shared-len tokens).
Targets, interleaved round by round: the engine in-process with sharing on and off, and
`tandem serve --mode colocated` (one worker, every core) with `--share-prefill` and
`--no-share-prefill`, each server started for its turn and measured over HTTP. Each row: wall
seconds until the last request finished, output tok/s, and the prompt tokens found in the prefix
cache (in-process: the requests' own count; served: the worker's `prefix_cache_hits` counter,
read from /metrics before and after). Medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from loadtest.serve_process import ServeProcess  # noqa: E402

TIMEOUT_S = 600.0


def workloads(args: argparse.Namespace, seed: int) -> dict[str, list[tuple[list[int], int]]]:
    """name -> [(prompt ids, choices)]: new prompts each round (an engine's prefix cache keeps
    the last round's), the same for every target within one."""
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(count)]

    system = ids(args.shared_len)
    return {
        "n": [(ids(args.prompt_len), args.n) for _ in range(args.prompts)],
        "system": [
            (system + ids(args.prompt_len - args.shared_len), 1)
            for _ in range(args.prompts * args.n)
        ],
    }


def run_inprocess(llm, requests: list[tuple[list[int], int]], output_len: int) -> dict:
    from protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    prompts = [prompt for prompt, n in requests for _ in range(n)]
    start = time.perf_counter()
    outputs = llm.generate_ids(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(out.token_ids) for out in outputs)
    return _row(seconds, tokens, sum(out.num_cached_tokens for out in outputs))


async def run_served(url: str, requests: list[tuple[list[int], int]], output_len: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, trust_env=False) as client:
        hits_before = await _prefix_hits(client)
        start = time.perf_counter()
        bodies = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={
                        "prompt": prompt,
                        "n": n,
                        "max_tokens": output_len,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )  # fmt: skip
                for prompt, n in requests
            )
        )
        seconds = time.perf_counter() - start
        for body in bodies:
            body.raise_for_status()
        tokens = sum(body.json()["usage"]["completion_tokens"] for body in bodies)
        return _row(seconds, tokens, await _prefix_hits(client) - hits_before)


async def _prefix_hits(client: httpx.AsyncClient) -> int:
    """The workers' prefix-cache hits so far (one worker: its series, or the pool's sum)."""
    text = (await client.get("/metrics")).text
    found = re.findall(r"^tandem:prefix_cache_hits(?:_total)?(?:\{[^}]*\})? (\S+)", text, re.M)
    return int(max(float(v) for v in found)) if found else 0


def _row(seconds: float, tokens: int, cached: int) -> dict:
    return {"seconds": seconds, "output_tok_s": tokens / seconds, "cached_prompt_tokens": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--shared-len", type=int, default=448)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="the engines' step budget (default: the device's, 256 on a CPU, 2,048 on a GPU)",
    )  # fmt: skip
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--json", type=Path, default=ROOT / "results" / "parallel_sampling.json")
    args = parser.parse_args()
    if args.model is None:
        from engine.fetch import fetch_default_model

        args.model = fetch_default_model()
    from engine.llm import LLM

    budget = args.max_num_batched_tokens
    engines = {
        on: LLM(args.model, share_prefill=on, max_num_batched_tokens=budget) for on in (True, False)
    }
    for on in (True, False):  # warm-up
        run_inprocess(engines[on], workloads(args, 0)["n"][:1], 2)
    rows: dict[str, list[dict]] = {}
    logs = Path(tempfile.mkdtemp(prefix="tandem-parallel-"))
    for round_ in range(1, args.rounds + 1):
        work = workloads(args, round_)
        for on in (True, False):
            how = "shared" if on else "each its own"
            for name, requests in work.items():
                row = run_inprocess(engines[on], requests, args.output_len)
                _keep(rows, f"{name} in-process {how}", row, round_)
            if args.skip_served:
                continue
            # One server at a time, started for its turn: the other's workers hold no cores.
            flags = ["--share-prefill" if on else "--no-share-prefill"]
            if budget is not None:
                flags += ["--max-num-batched-tokens", str(budget)]
            with ServeProcess(
                ["--model", str(args.model), "--mode", "colocated", "--prefill-workers", "0",
                 "--decode-workers", "1", *flags],
                logs / f"serve-{round_}-{on}.log",
            ) as server:  # fmt: skip
                server.wait_healthy(300)
                asyncio.run(run_served(server.url, workloads(args, 0)["n"][:1], 2))  # warm-up
                for name, requests in work.items():
                    row = asyncio.run(run_served(server.url, requests, args.output_len))
                    _keep(rows, f"{name} served {how}", row, round_)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": {
            label: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            for label, runs in rows.items()
        },
    }
    print_table(report["rows"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {args.json}")


def _keep(rows: dict[str, list[dict]], label: str, row: dict, round_: int) -> None:
    print(f"[round {round_}] {label}: {row['seconds']:.2f} s, {row['output_tok_s']:.0f} tok/s, "
          f"{row['cached_prompt_tokens']} prompt tokens cached", flush=True)  # fmt: skip
    rows.setdefault(label, []).append(row)


def print_table(rows: dict[str, dict]) -> None:
    print(f"\n{'workload / target':<34}{'seconds':>10}{'out tok/s':>12}{'cached prompt':>15}")
    for label, r in rows.items():
        print(f"{label:<34}{r['seconds']:>10.2f}{r['output_tok_s']:>12.0f}"
              f"{r['cached_prompt_tokens']:>15.0f}")  # fmt: skip
    for name in ("n", "system"):
        for where in ("in-process", "served"):
            shared, own = (
                rows.get(f"{name} {where} shared"),
                rows.get(f"{name} {where} each its own"),
            )
            if shared and own:
                print(f"{name} {where}: sharing {own['seconds'] / shared['seconds']:.2f}x faster")


if __name__ == "__main__":
    main()
