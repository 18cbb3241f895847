"""`tandem make-model`: a model folder with seeded random weights in a known architecture's shape,
for machines that can download nothing (engine/random_model.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cli.errors import CliError
from engine.random_model import ARCHITECTURES
from loadtest.cli import DefaultsFormatter


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "make-model",
        help="write a model folder with random weights in a known architecture's shape",
        description=(
            "Write config.json, safetensors and a tokenizer for a known architecture, with "
            "weights drawn from a seed: the same seed gives the same bytes on any machine."
        ),
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--arch", required=True, choices=list(ARCHITECTURES), help="shape to copy")
    p.add_argument("--out", type=Path, required=True, help="folder to write (absent or empty)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed")
    p.add_argument("--num-layers", type=int, help="fewer layers than the architecture's")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.random_model import make_model

    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise CliError(f"--out {args.out} exists and is not an empty folder")
    if args.num_layers is not None and args.num_layers < 1:
        raise CliError("--num-layers must be at least 1")
    most = ARCHITECTURES[args.arch].dims["num_hidden_layers"]
    if args.num_layers is not None and args.num_layers > most:
        raise CliError(f"--num-layers {args.num_layers}: {args.arch} has {most} layers")
    written = make_model(args.arch, args.out, seed=args.seed, num_layers=args.num_layers)
    print(f"wrote {args.out} ({written / 2**30:.2f} GiB of weights)", file=sys.stderr)
    print(args.out)
    return 0
