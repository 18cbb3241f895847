"""`tandem generate`: run prompts through a colocated engine and print the completions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.defaults import add_gpu_memory_flag, add_tensor_parallel_flag, default_of
from cli.errors import CliError
from engine.config import EngineConfig
from loadtest.cli import DefaultsFormatter
from protocol.kv import DTYPE_BYTES
from protocol.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 128
DEFAULT_TEMPERATURE = 0.0  # greedy unless asked: one command, one answer
TOP_K_OFF = (0, -1)  # what other tools take for "no top-k"; SamplingParams says None


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "generate",
        help="generate completions for prompts, offline",
        description="Generate completions for prompts with one in-process engine.",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--model", type=Path, help="model folder (default: the fetched default model)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="per completion")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0: greedy")
    p.add_argument(
        "--top-p", type=float, default=default_of(SamplingParams, "top_p"), help="nucleus mass"
    )
    p.add_argument(
        "--top-k",
        type=parse_top_k,
        default=default_of(SamplingParams, "top_k"),
        help="keep the K likeliest tokens; 0 or -1: off (the default)",
    )
    p.add_argument(
        "--seed", type=int, default=default_of(SamplingParams, "seed"), help="sampling seed"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate all --max-tokens")
    p.add_argument(
        "--dtype",
        default=default_of(EngineConfig, "dtype"),
        choices=list(DTYPE_BYTES),
        help="weights",
    )
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if present"
    )
    add_gpu_memory_flag(
        p,
        "CUDA: the share of the GPU's memory the engine may hold; its KV cache gets the rest "
        "(default: a KV cache of 1 GiB)",
    )
    add_tensor_parallel_flag(
        p, "split the model across N ranks (local processes: GPUs, or CPU cores)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(run=run)


def parse_top_k(text: str) -> int | None:
    """'40' -> 40; '0' and '-1' -> None (off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1 and value not in TOP_K_OFF:
        raise argparse.ArgumentTypeError(f"{value} is not a top-k: give 1 or more, or 0 for off")
    return None if value in TOP_K_OFF else value


def run(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(
        _model_folder(args.model),
        dtype=args.dtype,
        device=_device(args.device),
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    try:
        if params.max_tokens > llm.engine.max_model_len:  # as `tandem serve` refuses it
            raise CliError(
                f"--max-tokens {params.max_tokens} is more than this model's context "
                f"({llm.engine.max_model_len} tokens)"
            )
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
    finally:
        llm.close()
    for output in outputs:
        if args.json:
            record = {
                "text": output.text,
                "token_ids": list(output.token_ids),
                "finish_reason": output.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(output.text)
    return 0


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: torch sees no CUDA device here")
    return name


def _model_folder(model: Path | None) -> Path:
    if model is None:
        from engine.fetch import fetch_default_model

        return fetch_default_model()
    if not model.is_dir():
        raise CliError(f"model folder {model} does not exist")
    return model
