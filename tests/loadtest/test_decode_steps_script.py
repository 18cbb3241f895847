"""benchmarks/decode_steps.py (engine_throughput.py --steps) on the CPU at toy sizes: every row
measured or said skipped, the throughput run's exact token count, JSON after each model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import decode_steps


def args_for(tmp_path: Path, **changes) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    decode_steps.add_flags(parser)
    args = parser.parse_args([])
    args.__dict__.update(
        device="cpu", dtype="bfloat16", arch=["smollm2-135m"], num_layers=1,
        models_dir=tmp_path / "models", batches=[1, 4], contexts=[16, 40], requests=3,
        input_len=8, output_len=5, max_num_batched_tokens=256, json=tmp_path / "out.json",
    )  # fmt: skip
    args.__dict__.update(changes)
    return args


def test_sweep_measures_every_shape_and_counts_the_tokens(tmp_path: Path) -> None:
    report = decode_steps.run(args_for(tmp_path))
    [result] = report["results"]
    assert result["errors"] == []
    graphs = {(r["batch"], r["context"]) for r in result["rows"] if r["graphs"]}
    assert graphs == {(1, 16), (4, 16), (1, 40), (4, 40)}
    eager = [r for r in result["rows"] if not r["graphs"]]
    assert [(r["batch"], r["context"]) for r in eager] == [(1, 16)]  # EAGER_BATCHES up to 4
    for row in result["rows"]:
        assert row["step_ms"] > 0 and row["floor_ms"] >= row["weights_floor_ms"] > 0
    assert result["throughput"]["output_tokens"] == 3 * 5
    assert json.loads((tmp_path / "out.json").read_text())["results"][0]["arch"] == "smollm2-135m"


def test_a_batch_whose_kv_does_not_fit_is_skipped_and_said(tmp_path: Path) -> None:
    # One layer of SmolLM2's shape holds 3 KV heads x 64 x (K, V) x 2 bytes = 768 bytes a
    # token, 12 KiB a block of 16: five blocks hold one sequence of 40 (+ the timed steps),
    # not four of them.
    args = args_for(tmp_path, batches=[1, 4], contexts=[40], cpu_kv_bytes=5 * 12288)
    [result] = decode_steps.run(args)["results"]
    skipped = [r for r in result["rows"] if "skipped" in r]
    assert [(r["batch"], r["context"]) for r in skipped] == [(4, 40)]
