"""Helpers shared by the load-test tests: parse `tandem bench` flags with the real parser, run
a benchmark in-process, and a whitespace token counter matching the fake server's."""

from __future__ import annotations

import argparse
import io

from loadtest import cli as bench_cli
from loadtest.bench import run_bench
from loadtest.results import Record

QUIET = ("--disable-tqdm",)


def parse_bench(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem")
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def bench(url: str, *argv: str) -> Record:
    """Runs `tandem bench --base-url URL ARGV...` in-process, quietly, and returns its record."""
    config = bench_cli.config_from_args(parse_bench("--base-url", url, *QUIET, *argv))
    return run_bench(config, out=io.StringIO())


class WhitespaceCounter:
    """Counts tokens the way the fake server does: one per whitespace-separated word."""

    def __init__(self) -> None:
        self.calls = 0

    def count(self, text: str) -> int:
        self.calls += 1
        return len(text.split())
