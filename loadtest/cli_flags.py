"""The flags of `tandem bench`: `vllm bench serve`'s spellings, defaults where tandem keeps
vLLM's, and meanings, so a vLLM command line runs with `tandem bench` in its place; tandem's own
flags beside them. `cli.py` maps the parsed flags to a `BenchConfig`."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.config import (
    DatasetConfig,
    MixedSpec,
    PrefixRepetitionSpec,
    RandomSpec,
)
from loadtest.vllm_compat import add_refused_flags

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DATASETS = ("random", "sharegpt", "prefix_repetition", "mixed")
DATASET_ALIASES = {"prefix-repetition": "prefix_repetition"}  # tandem's earlier spelling
BACKENDS = ("openai", "openai-chat", "vllm")


def add_bench_flags(parser: argparse.ArgumentParser, taken: tuple[str, ...] = ()) -> None:
    """`taken`: flags the command defines itself (tandem plan's --profile), not refused."""
    _add_target_flags(parser.add_argument_group("target"))
    _add_dataset_flags(parser.add_argument_group("workload"))
    _add_load_flags(parser.add_argument_group("load and sampling"))
    _add_output_flags(parser.add_argument_group("metrics and output"))
    add_refused_flags(parser, taken)


def _add_target_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--backend",
        metavar="{" + ",".join(BACKENDS) + "}",
        help="request format: openai and vllm send completions, openai-chat chat completions "
        "(default: the one --endpoint implies)",
    )
    g.add_argument(
        "--base-url", help="server root, without /v1 (default: http://HOST:PORT from --host/--port)"
    )
    g.add_argument("--host", default=DEFAULT_HOST, help="server host when no --base-url")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="server port when no --base-url")
    g.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions or /v1/chat/completions (or a path ending so)",
    )
    g.add_argument("--model", help="model id to request (default: the first at /v1/models)")
    g.add_argument("--served-model-name", help="model field of requests, when not --model")
    g.add_argument(
        "--api-key", help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)"
    )
    g.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra request headers")
    g.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR_OR_ID",
        help="Hugging Face tokenizer folder or id (default: the server's POST /tokenize)",
    )
    g.add_argument(
        "--trust-remote-code", action="store_true", help="let the tokenizer run its own code"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metavar="S",
        help="a request still running after S seconds fails",
    )


def _add_dataset_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--dataset-name",
        default="random",
        metavar="{" + ",".join(DATASETS) + "}",
        help="workload (prefix-repetition also names prefix_repetition)",
    )
    g.add_argument("--dataset-path", type=Path, help="ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=DatasetConfig.num_prompts, help="requests")
    g.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")
    g.add_argument("--input-len", type=int, help="sets --random-input-len")
    g.add_argument("--output-len", type=int, help="sets every dataset's output length")
    g.add_argument("--random-input-len", type=int, default=RandomSpec.input_len, help="tokens")
    g.add_argument("--random-output-len", type=int, default=RandomSpec.output_len, help="tokens")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=RandomSpec.range_ratio,
        help="lengths uniform in [len * (1 - r), len * (1 + r)] (random and mixed)",
    )
    g.add_argument(
        "--random-prefix-len", type=int, default=RandomSpec.prefix_len, help="shared prefix"
    )
    g.add_argument("--sharegpt-output-len", type=int, help="(default: the recorded reply's)")
    g.add_argument(
        "--disable-shuffle", action="store_true", help="ShareGPT conversations in file order"
    )
    g.add_argument(
        "--no-oversample",
        action="store_true",
        help="accepted: tandem never repeats conversations to reach --num-prompts",
    )
    for flag in ("--no-stream", "--skip-chat-template"):
        g.add_argument(flag, action="store_true", help="accepted: no tandem dataset uses it")
    for name, default in (
        ("num-prefixes", PrefixRepetitionSpec.num_prefixes),
        ("prefix-len", PrefixRepetitionSpec.prefix_len),
        ("suffix-len", PrefixRepetitionSpec.suffix_len),
        ("output-len", PrefixRepetitionSpec.output_len),
    ):
        help_text = "prefixes" if name == "num-prefixes" else "tokens"
        g.add_argument(f"--prefix-repetition-{name}", type=int, default=default, help=help_text)
    g.add_argument("--mixed-short-len", type=int, default=MixedSpec.short_len, help="tokens")
    g.add_argument("--mixed-long-len", type=int, default=MixedSpec.long_len, help="tokens")
    g.add_argument(
        "--mixed-long-fraction",
        type=float,
        default=MixedSpec.long_fraction,
        help="share of long prompts (outputs: --random-output-len)",
    )


def _add_load_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s; inf sends all at once"
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="1: Poisson; gamma shape of the gaps"
    )
    g.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    g.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests first")
    g.add_argument("--max-duration", type=float, metavar="S", help="end the run after S seconds")
    g.add_argument("--ignore-eos", action="store_true", help="generate all max_tokens")
    g.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature; default: not sent (the server's default), as vLLM's",
    )
    for flag, kind in (
        ("--top-p", float),
        ("--top-k", int),
        ("--min-p", float),
        ("--frequency-penalty", float),
        ("--presence-penalty", float),
        ("--repetition-penalty", float),
    ):
        g.add_argument(flag, type=kind, help="(default: the server's)")
    g.add_argument("--extra-body", metavar="JSON", help="object merged into every request body")
    g.add_argument(
        "--sweep",
        metavar="NAME=V1,V2,...",
        help="one run per value of request-rate or max-concurrency, e.g. request-rate=1,2,4",
    )


def _add_output_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--percentile-metrics",
        metavar="M1,M2,...",
        help="metrics the table shows, of ttft,tpot,itl,e2el (default: all; JSON has all)",
    )
    g.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    g.add_argument(
        "--save-result", action=_Switch, default=False, help="save the JSON result (a switch)"
    )
    g.add_argument("--result-dir", type=Path, help="where --save-result writes (default: .)")
    g.add_argument(
        "--result-filename",
        help="file name for --save-result (default: vLLM's "
        "BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json, BACKEND being --label when given)",
    )
    g.add_argument(
        "--result-path",
        type=Path,
        metavar="PATH",
        help="save the JSON result at PATH (as --save-result --result-filename PATH)",
    )
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="accepted: per-request lists are always saved",
    )
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="extra keys of the result")
    g.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots here")
    g.add_argument("--label", help="name of this run: result file prefix, comparisons")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


class _Switch(argparse.Action):
    """A store_true switch, as vLLM's --save-result; given a value (tandem's --save-result once
    took a path), it fails naming --result-path. A vLLM command line never gives it one."""

    shown_as_switch = True  # DefaultsFormatter shows no value

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs="?", **kwargs)  # type: ignore[arg-type]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        if values is not None:
            hint = f"save to a path with --result-path {values}"
            parser.error(f"{option_string} is a switch, as in vLLM; {hint}")
        setattr(namespace, self.dest, True)
