"""`tandem bench`: load-test an OpenAI-compatible server (tandem, vLLM, SGLang) with the metric
definitions, JSON keys and command line of `vllm bench serve`; `tandem bench compare` puts saved
results side by side. This module maps the flags (`cli_flags.py`) to a `BenchConfig`; `cli.main`
registers it through `add_parser` and prints a `BenchError` as one line. It imports nothing from
`cli/` or `coordinator/`: the command line depends on the load tester, never the reverse."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from loadtest.cli_flags import BACKENDS, DATASET_ALIASES, DATASETS, add_bench_flags
from loadtest.config import (
    Backend,
    BenchConfig,
    DatasetConfig,
    DatasetSpec,
    LoadConfig,
    MixedSpec,
    OutputConfig,
    PrefixRepetitionSpec,
    RandomSpec,
    ResultFile,
    SamplingConfig,
    ShareGPTSpec,
    TargetConfig,
)
from loadtest.errors import BenchError
from loadtest.vllm_compat import refuse_unhonoured


class DefaultsFormatter(argparse.HelpFormatter):
    """Shows a flag's default, unless it has none or its help already speaks of it. `tandem
    serve` and `tandem generate` use it too (cli/ may import loadtest/, not the reverse)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        hidden = action.default is None or action.default is False
        if hidden or action.default == argparse.SUPPRESS or "default" in text:
            return text
        return f"{text} (default: %(default)s)"

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if getattr(action, "shown_as_switch", False):  # cli_flags._Switch
            return ""
        return super()._format_args(action, default_metavar)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server",
        description="Load-test an OpenAI-compatible server with the flags of 'vllm bench serve'; "
        "'tandem bench compare A.json B.json' compares saved results.",
        formatter_class=DefaultsFormatter,
    )
    add_bench_flags(p)
    p.set_defaults(run=run)
    sub = p.add_subparsers(dest="bench_command", metavar="{compare}", parser_class=type(p))
    compare = sub.add_parser("compare", help="compare saved results side by side")
    compare.add_argument("results", nargs="+", type=Path, help="result files of --save-result")
    compare.add_argument("--plot", type=Path, metavar="DIR", help="write overlaid plots here")


def run(args: argparse.Namespace) -> int:
    """Raises BenchError for failures the user can act on."""
    if args.bench_command == "compare":
        return _compare(args.results, args.plot)
    from loadtest.bench import run_bench

    run_bench(config_from_args(args), out=sys.stdout)
    return 0


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from loadtest.sweep import parse_sweep

    refuse_unhonoured(args)
    args = _with_general_lengths(args)
    return BenchConfig(
        target=_target_config(args),
        dataset=DatasetConfig(_dataset_spec(args), num_prompts=args.num_prompts, seed=args.seed),
        sampling=_sampling_config(args),
        load=LoadConfig(
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            num_warmups=args.num_warmups,
            max_duration_s=args.max_duration,
            seed=args.seed,
        ),
        output=_output_config(args),
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        sweep=parse_sweep(args.sweep) if args.sweep else None,
    )


def _with_general_lengths(args: argparse.Namespace) -> argparse.Namespace:
    """vLLM's --input-len / --output-len, written over the per-dataset lengths."""
    lengths = {}
    if args.input_len is not None:
        lengths["random_input_len"] = args.input_len
    if args.output_len is not None:
        for name in ("random", "sharegpt", "prefix_repetition"):
            lengths[f"{name}_output_len"] = args.output_len
    return argparse.Namespace(**{**vars(args), **lengths})


def _target_config(args: argparse.Namespace) -> TargetConfig:
    from loadtest.config import parse_pairs

    if args.backend is not None and args.backend not in BACKENDS:
        raise BenchError(
            f"--backend {args.backend} is not supported by tandem bench "
            f"(it sends {', '.join(BACKENDS)})"
        )
    return TargetConfig(
        base_url=args.base_url or f"http://{_host_port(args.host, args.port)}",
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        request_timeout_s=args.request_timeout,
        backend=None if args.backend is None else Backend(args.backend),
        served_model_name=args.served_model_name,
        headers=parse_pairs(args.header, "--header") if args.header else (),
    )


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets


def _sampling_config(args: argparse.Namespace) -> SamplingConfig:
    return SamplingConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        # As vllm bench serve: random prompts run to the requested length.
        ignore_eos=args.ignore_eos or args.dataset_name == "random",
        min_p=args.min_p,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
        extra_body=_json_object(args.extra_body, "--extra-body") if args.extra_body else None,
    )


def _json_object(text: str, flag: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise BenchError(f"{flag} {text!r} is not valid JSON: {err.msg}") from None
    if not isinstance(value, dict):
        raise BenchError(f"{flag} {text!r} is not a JSON object")
    return value


def _output_config(args: argparse.Namespace) -> OutputConfig:
    from loadtest.config import (
        METRICS,
        parse_goodput,
        parse_pairs,
        parse_percentile_metrics,
        parse_percentiles,
    )

    metrics = args.percentile_metrics
    return OutputConfig(
        percentiles=parse_percentiles(args.metric_percentiles),
        percentile_metrics=parse_percentile_metrics(metrics) if metrics else METRICS,
        goodput=parse_goodput(args.goodput) if args.goodput else None,
        label=args.label,
        save_result=_result_file(args),
        metadata=parse_pairs(args.metadata, "--metadata") if args.metadata else (),
        plot_dir=args.plot,
        show_progress=not args.disable_tqdm,
    )


def _result_file(args: argparse.Namespace) -> ResultFile | None:
    if args.result_path is not None:
        if args.result_dir is not None or args.result_filename is not None:
            raise BenchError("--result-path is a whole path; drop --result-dir/--result-filename")
        return ResultFile(filename=str(args.result_path))
    if not args.save_result:
        return None  # as vLLM: --result-dir and --result-filename alone save nothing
    return ResultFile(args.result_dir, args.result_filename)


def _dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    name = DATASET_ALIASES.get(args.dataset_name, args.dataset_name)
    if name not in DATASETS:
        raise BenchError(
            f"--dataset-name {args.dataset_name} is not supported by tandem bench "
            f"(it has {', '.join(DATASETS)})"
        )
    if args.dataset_path is not None and name != "sharegpt":
        raise BenchError(f"--dataset-path is read by --dataset-name sharegpt only, not {name}")
    builders: dict[str, Callable[[argparse.Namespace], DatasetSpec]] = {
        "random": lambda a: RandomSpec(
            a.random_input_len, a.random_output_len, a.random_range_ratio, a.random_prefix_len
        ),
        "sharegpt": _sharegpt_spec,
        "prefix_repetition": lambda a: PrefixRepetitionSpec(
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
    return builders[name](args)


def _sharegpt_spec(args: argparse.Namespace) -> ShareGPTSpec:
    if args.dataset_path is None:
        raise BenchError("--dataset-name sharegpt needs --dataset-path")
    return ShareGPTSpec(
        args.dataset_path, args.sharegpt_output_len, shuffle=not args.disable_shuffle
    )


def _compare(paths: list[Path], plot_dir: Path | None) -> int:
    from loadtest.compare import compare_table, load_labelled, plot_comparison
    from loadtest.results import check_plot_dir

    if plot_dir is not None:
        check_plot_dir(plot_dir)
    labelled = load_labelled(paths)
    print(compare_table(labelled))
    if plot_dir is not None:
        plot_comparison(labelled, plot_dir)
    return 0
