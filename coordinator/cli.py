"""The `tandem` command line. Each subcommand lives in its own module; this file dispatches and
turns every expected failure into one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from coordinator import bench_cmd, generate_cmd, serve_cmd

EXIT_FAILURE = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A failure the user can act on; printed as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    fetch = commands.add_parser("fetch-model", help="prepare the default model, print its folder")
    fetch.set_defaults(run=_fetch_model)
    generate_cmd.add_parser(commands)
    bench_cmd.add_parser(commands)
    serve_cmd.add_parser(commands)
    return parser


def _fetch_model(args: argparse.Namespace) -> int:
    from engine.fetch import fetch_default_model

    print(fetch_default_model(log=lambda line: print(line, file=sys.stderr)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # every failure becomes one line; TANDEM_DEBUG=1 shows the trace
        if os.environ.get("TANDEM_DEBUG"):
            raise
        print(f"tandem {args.command}: error: {_describe(err)}", file=sys.stderr)
        return EXIT_FAILURE


def _describe(err: Exception) -> str:
    from engine.config import ConfigError
    from engine.engine import RequestError
    from engine.fetch import FetchError
    from engine.sampling_params import SamplingError
    from engine.tokenizer import TokenizerError
    from engine.weights import WeightsError

    expected = (
        CliError, ConfigError, FetchError, RequestError, SamplingError, TokenizerError, WeightsError
    )  # fmt: skip
    if isinstance(err, expected):
        return str(err)
    return f"{type(err).__name__}: {err}"


if __name__ == "__main__":
    sys.exit(main())
