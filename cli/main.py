"""The `tandem` command line. Each subcommand lives in its own module (`bench` in `loadtest.cli`);
this file dispatches and turns every expected failure into one line on stderr and a non-zero exit.
Subcommand modules never import this one: they raise `cli.errors.CliError` (or `BenchError`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from cli import generate, make_model, plan, pool, profile, serve, simulate
from cli.errors import CliError
from loadtest import cli as bench_cli
from loadtest.errors import BenchError

EXIT_FAILURE = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    fetch = commands.add_parser("fetch-model", help="prepare the default model, print its folder")
    fetch.set_defaults(run=_fetch_model)
    generate.add_parser(commands)
    bench_cli.add_parser(commands)
    serve.add_parser(commands)
    pool.add_parser(commands)
    profile.add_parser(commands)
    simulate.add_parser(commands)
    plan.add_parser(commands)
    make_model.add_parser(commands)
    return parser


def _fetch_model(args: argparse.Namespace) -> int:
    from engine.fetch import fetch_default_model

    print(fetch_default_model(log=lambda line: print(line, file=sys.stderr)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser: its name, its --help
        _subcommand(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
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


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    return parser


def _describe(err: Exception) -> str:
    if isinstance(err, (CliError, BenchError)):  # before the engine's errors, which load torch
        return str(err)
    from engine.config import ConfigError
    from engine.fetch import FetchError
    from engine.tokenizer import TokenizerError
    from engine.weights import WeightsError
    from protocol.errors import RequestError
    from protocol.sampling import SamplingError

    expected = (ConfigError, FetchError, RequestError, SamplingError, TokenizerError, WeightsError)
    if isinstance(err, expected):
        return str(err)
    return f"{type(err).__name__}: {err}"


if __name__ == "__main__":
    sys.exit(main())
