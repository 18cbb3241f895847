"""`tandem bench`: load-test an OpenAI-compatible server (tandem, vLLM, SGLang) with the metric
definitions and JSON keys of `vllm bench serve`; `tandem bench compare` puts saved results side
by side. This module only maps flags to a `BenchConfig`; `cli.main` registers it through
`add_parser` and prints a `BenchError` as one line. It imports nothing from `cli/` or
`coordinator/`: the command line depends on the load tester, never the reverse."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from loadtest.config import (
    BenchConfig,
    DatasetConfig,
    DatasetSpec,
    LoadConfig,
    MixedSpec,
    OutputConfig,
    PrefixRepetitionSpec,
    RandomSpec,
    SamplingConfig,
    ShareGPTSpec,
    TargetConfig,
)
from loadtest.errors import BenchError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DATASETS = ("random", "sharegpt", "prefix-repetition", "mixed")


class DefaultsFormatter(argparse.HelpFormatter):
    """Shows a flag's default, unless it has none or its help already speaks of it. `tandem
    serve` and `tandem generate` use it too (cli/ may import loadtest/, not the reverse)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        hidden = action.default is None or action.default is False
        if hidden or action.default == argparse.SUPPRESS or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server",
        description="Load-test an OpenAI-compatible server; 'tandem bench compare A.json B.json' "
        "compares saved results.",
        formatter_class=DefaultsFormatter,
    )
    _add_target_flags(p.add_argument_group("target"))
    _add_dataset_flags(p.add_argument_group("workload"))
    _add_load_flags(p.add_argument_group("load"))
    _add_output_flags(p.add_argument_group("metrics and output"))
    p.set_defaults(run=run)
    sub = p.add_subparsers(dest="bench_command", metavar="{compare}", parser_class=type(p))
    compare = sub.add_parser("compare", help="compare saved results side by side")
    compare.add_argument("results", nargs="+", type=Path, help="result files of --save-result")
    compare.add_argument("--plot", type=Path, metavar="DIR", help="write overlaid plots here")


def _add_target_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server root, without /v1")
    g.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions or /v1/chat/completions (or a path ending so)",
    )
    g.add_argument("--model", help="model id to request (default: the first at /v1/models)")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="Hugging Face tokenizer folder (default: the server's POST /tokenize)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metavar="S",
        help="a request still running after S seconds fails",
    )


def _add_dataset_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dataset-name", choices=DATASETS, default="random", help="workload")
    g.add_argument("--dataset-path", type=Path, help="ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=DatasetConfig.num_prompts, help="requests")
    g.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")
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
        "--prefix-repetition-num-prefixes",
        type=int,
        default=PrefixRepetitionSpec.num_prefixes,
        help="prefixes",
    )
    g.add_argument(
        "--prefix-repetition-prefix-len",
        type=int,
        default=PrefixRepetitionSpec.prefix_len,
        help="tokens",
    )
    g.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        default=PrefixRepetitionSpec.suffix_len,
        help="tokens",
    )
    g.add_argument(
        "--prefix-repetition-output-len",
        type=int,
        default=PrefixRepetitionSpec.output_len,
        help="tokens",
    )
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
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, help="(default: the server's)")
    g.add_argument("--top-k", type=int, help="(default: the server's)")
    g.add_argument(
        "--sweep",
        metavar="NAME=V1,V2,...",
        help="one run per value of request-rate or max-concurrency, e.g. request-rate=1,2,4",
    )


def _add_output_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--save-result", type=Path, metavar="PATH", help="write the JSON result here")
    g.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots here")
    g.add_argument("--label", help="name of this run in comparisons")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Raises BenchError for failures the user can act on."""
    if args.bench_command == "compare":
        return _compare(args.results, args.plot)
    from loadtest.bench import run_bench

    run_bench(config_from_args(args), out=sys.stdout)
    return 0


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from loadtest.config import parse_goodput, parse_percentiles
    from loadtest.sweep import parse_sweep

    return BenchConfig(
        target=TargetConfig(
            base_url=args.base_url,
            endpoint=args.endpoint,
            model=args.model,
            api_key=args.api_key,
            request_timeout_s=args.request_timeout,
        ),
        dataset=DatasetConfig(_dataset_spec(args), num_prompts=args.num_prompts, seed=args.seed),
        sampling=SamplingConfig(args.temperature, args.top_p, args.top_k, args.ignore_eos),
        load=LoadConfig(
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            num_warmups=args.num_warmups,
            max_duration_s=args.max_duration,
            seed=args.seed,
        ),
        output=OutputConfig(
            percentiles=parse_percentiles(args.metric_percentiles),
            goodput=parse_goodput(args.goodput) if args.goodput else None,
            label=args.label,
            save_result=args.save_result,
            plot_dir=args.plot,
            show_progress=not args.disable_tqdm,
        ),
        tokenizer=args.tokenizer,
        sweep=parse_sweep(args.sweep) if args.sweep else None,
    )


def _dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    builders: dict[str, Callable[[argparse.Namespace], DatasetSpec]] = {
        "random": lambda a: RandomSpec(
            a.random_input_len, a.random_output_len, a.random_range_ratio, a.random_prefix_len
        ),
        "sharegpt": _sharegpt_spec,
        "prefix-repetition": lambda a: PrefixRepetitionSpec(
            a.prefix_repetition_num_prefixes,
            a.prefix_repetition_prefix_len,
            a.prefix_repetition_suffix_len,
            a.prefix_repetition_output_len,
        ),
        "mixed": lambda a: MixedSpec(
            a.mixed_short_len,
            a.mixed_long_len,
            a.mixed_long_fraction,
            a.random_output_len,
            a.random_range_ratio,
        ),
    }
    return builders[args.dataset_name](args)


def _sharegpt_spec(args: argparse.Namespace) -> ShareGPTSpec:
    if args.dataset_path is None:
        raise BenchError("--dataset-name sharegpt needs --dataset-path")
    return ShareGPTSpec(args.dataset_path, args.sharegpt_output_len)


def _compare(paths: list[Path], plot_dir: Path | None) -> int:
    from loadtest.compare import compare_table, load_labelled, plot_comparison

    labelled = load_labelled(paths)
    print(compare_table(labelled))
    if plot_dir is not None:
        plot_comparison(labelled, plot_dir)
    return 0
