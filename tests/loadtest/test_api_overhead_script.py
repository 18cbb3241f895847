"""benchmarks/api_overhead.py end to end on a tiny tokenizer: a serving process over the free
backend, `tandem bench` against it, and CPU per token read back."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "api_overhead.py"
_spec = importlib.util.spec_from_file_location("api_overhead", SCRIPT)
api_overhead = importlib.util.module_from_spec(_spec)
sys.modules["api_overhead"] = api_overhead
_spec.loader.exec_module(api_overhead)


def test_a_small_run_streams_every_token_and_reports_its_cost(tiny_llama, tmp_path, capsys):
    out = tmp_path / "api.json"
    argv = "--concurrency 2 --num-prompts 6 --input-len 8 --output-len 5 --tick-ms 2 --rounds 1"
    argv = [*argv.split(), "--tokenizer", str(tiny_llama), "--json", str(out)]
    assert api_overhead.main(argv) == 0
    report = json.loads(out.read_text())
    (round_,) = report["rounds"]
    assert round_["tokens"] == 30  # main() checks every prompt streamed all its tokens
    assert round_["server_us"] > 0 and round_["server_us"] == report["summary"]["server_us"]
    assert round_["ceiling_tok_s"] == pytest.approx(1e6 / round_["server_us"])
    assert round_["itl_p50_ms"] >= 1.0  # a token per 2 ms tick, at the least a tick apart
    assert "ceiling tok/s" in capsys.readouterr().out
