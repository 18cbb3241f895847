"""`tandem generate`: run prompts through a colocated engine and print the completions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_MAX_TOKENS = 128


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate completions for prompts, offline")
    p.add_argument("--model", type=Path, help="model folder (default: the fetched default model)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(_model_folder(args.model), dtype=args.dtype)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for output in outputs:
        if args.json:
            record = {
                "text": output.text,
                "token_ids": output.token_ids,
                "finish_reason": output.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(output.text)
    return 0


def _model_folder(model: Path | None) -> Path:
    from coordinator.cli import CliError

    if model is None:
        from engine.fetch import fetch_default_model

        return fetch_default_model()
    if not model.is_dir():
        raise CliError(f"model folder {model} does not exist")
    return model
