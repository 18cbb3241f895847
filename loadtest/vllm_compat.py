"""The flags of `vllm bench serve` that tandem cannot honour. They are parsed with vLLM's arity, so
a vLLM command line reads the same, and then refused with one line naming the flag: never
ignored. A flag at the value that changes nothing (`--ready-check-timeout-sec 0`) passes."""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable
from typing import NamedTuple

from loadtest.errors import BenchError


class Arity(enum.Enum):
    SWITCH = "switch"  # store_true
    ONE = "one"  # one value
    MANY = "many"  # one or more values


class RefusedFlag(NamedTuple):
    flag: str
    arity: Arity
    reason: str
    harmless: Callable[[str], bool] | None = None  # a value given that changes nothing

    @property
    def dest(self) -> str:
        return "vllm_" + self.flag.removeprefix("--").replace("-", "_")


def _is_zero(value: str) -> bool:
    try:
        return float(value) == 0
    except ValueError:
        return False


_PROFILER = "tandem bench drives no server profiler"
_PLOTS = "tandem draws its plots with --plot DIR"
_RAMP = "use --sweep request-rate=R1,R2,... for load steps"
_DATASET = "its dataset is not one tandem bench samples"
_SWITCHES = {
    "--profile": _PROFILER,
    "--append-result": "tandem writes one result per file; name files with --result-filename",
    "--plot-timeline": _PLOTS,
    "--plot-dataset-stats": _PLOTS,
    "--use-beam-search": "tandem bench sends sampling requests only",
    "--skip-tokenizer-init": "tandem bench counts tokens with a tokenizer or /tokenize",
    "--insecure": "TLS verification cannot be turned off",
    "--self-timed": "no tandem dataset carries timestamps",
    "--no-self-timed": "no tandem dataset carries timestamps",
    "--no-reranker": _DATASET,
}
_VALUES = {
    "--logprobs": "tandem bench requests no logprobs",
    "--request-id-prefix": "tandem bench sends no request ids",
    "--lora-assignment": "tandem bench sends no LoRA requests",
    "--ramp-up-strategy": _RAMP,
    "--ramp-up-start-rps": _RAMP,
    "--ramp-up-end-rps": _RAMP,
    "--chat-template-kwargs": "no tandem dataset applies a chat template",
    "--timeline-itl-thresholds": _PLOTS,
    "--custom-output-len": _DATASET,
    "--spec-bench-output-len": _DATASET,
    "--spec-bench-category": _DATASET,
    "--sonnet-input-len": _DATASET,
    "--sonnet-output-len": _DATASET,
    "--sonnet-prefix-len": _DATASET,
    "--blazedit-min-distance": _DATASET,
    "--blazedit-max-distance": _DATASET,
    "--random-mm-base-items-per-request": _DATASET,
    "--random-mm-num-mm-items-range-ratio": _DATASET,
    "--random-mm-limit-mm-per-prompt": _DATASET,
    "--random-mm-bucket-config": _DATASET,
    "--hf-subset": _DATASET,
    "--hf-split": _DATASET,
    "--hf-name": _DATASET,
    "--hf-output-len": _DATASET,
}
REFUSED = (
    *(RefusedFlag(flag, Arity.SWITCH, reason) for flag, reason in _SWITCHES.items()),
    *(RefusedFlag(flag, Arity.ONE, reason) for flag, reason in _VALUES.items()),
    RefusedFlag("--lora-modules", Arity.MANY, "tandem bench sends no LoRA requests"),
    RefusedFlag(
        "--ready-check-timeout-sec",
        Arity.ONE,
        "tandem bench probes the server once; start it first",
        _is_zero,
    ),
    RefusedFlag("--probe-request-rate", Arity.ONE, "tandem bench sends no side probes", _is_zero),
    RefusedFlag("--random-batch-size", Arity.ONE, "batches are for embeddings", lambda v: v == "1"),
    RefusedFlag(
        "--tokenizer-mode",
        Arity.ONE,
        "tandem loads tokenizers with transformers' AutoTokenizer",
        lambda v: v in ("auto", "hf"),
    ),
)


def add_refused_flags(parser: argparse.ArgumentParser, taken: tuple[str, ...] = ()) -> None:
    """Registers every refused flag but those in `taken`, hidden from --help."""
    for refused in REFUSED:
        if refused.flag in taken:
            continue
        if refused.arity is Arity.SWITCH:
            parser.add_argument(
                refused.flag, dest=refused.dest, action="store_true", help=argparse.SUPPRESS
            )
        else:
            nargs = "+" if refused.arity is Arity.MANY else None
            parser.add_argument(
                refused.flag, dest=refused.dest, nargs=nargs, help=argparse.SUPPRESS
            )


def refuse_unhonoured(args: argparse.Namespace) -> None:
    """Raises BenchError naming the first refused flag given with an effect."""
    for refused in REFUSED:
        value = getattr(args, refused.dest, None)
        if value is None or value is False:
            continue
        if isinstance(value, str) and refused.harmless and refused.harmless(value):
            continue
        given = refused.flag if isinstance(value, bool) else f"{refused.flag} {_words(value)}"
        raise BenchError(f"{given} is not supported by tandem bench: {refused.reason}")


def _words(value: str | list[str]) -> str:
    return value if isinstance(value, str) else " ".join(value)
