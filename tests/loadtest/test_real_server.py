"""`tandem bench` against a real `tandem serve` (disaggregated, tiny checkpoint, CPU): zero
failures, a result file that vLLM's result readers accept, and a server that exits 0 on SIGINT."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cli import main as cli
from loadtest.serve_process import ServeProcess

NUM_PROMPTS = 8
INPUT_LEN = 32
OUTPUT_LEN = 16
START_TIMEOUT_S = 120
SHUTDOWN_GRACE_S = 20
SERVE_ARGS = (
    "--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "256",
    "--max-model-len", "256", "--log-level", "warning", "--shutdown-grace", str(SHUTDOWN_GRACE_S),
)  # fmt: skip
# The keys vLLM's nightly benchmark scripts read from a `vllm bench serve` result
# (.buildkite/nightly-benchmarks/scripts/convert-results-json-to-markdown.py), and the other
# scalars `vllm bench serve --save-result` writes.
VLLM_COUNTS = ("completed", "total_input_tokens", "total_output_tokens")
VLLM_RATES = ("duration", "request_throughput", "output_throughput", "total_token_throughput")
VLLM_LATENCIES = tuple(
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p99")
)
VLLM_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def read_like_vllm(path: Path) -> dict:
    """Reads a result the way vLLM's readers do: plain JSON, the scalars by name as ints and
    floats, the per-request lists parallel. Fails on anything they would trip over."""
    record = json.loads(path.read_text(encoding="utf-8"))
    for key in VLLM_COUNTS:
        assert type(record[key]) is int, key
    for key in (*VLLM_RATES, *VLLM_LATENCIES):
        assert type(record[key]) is float and math.isfinite(record[key]), key
    assert record["request_goodput"] is None or type(record["request_goodput"]) is float
    lengths = {key: len(record[key]) for key in VLLM_PER_REQUEST}
    assert set(lengths.values()) == {record["completed"]}, lengths
    assert all(type(n) is int for key in ("input_lens", "output_lens") for n in record[key])
    assert all(type(t) is float for t in record["ttfts"])
    assert all(type(gap) is float for gaps in record["itls"] for gap in gaps)
    assert all(type(text) is str for text in record["generated_texts"])
    return record


@pytest.fixture
def server(tiny_llama, tmp_path: Path):
    args = ("--model", str(tiny_llama), "--mode", "disaggregated", *SERVE_ARGS)
    with ServeProcess(args, tmp_path / "serve.log") as process:
        process.wait_healthy(START_TIMEOUT_S)
        yield process


def test_bench_a_real_server(server: ServeProcess, tmp_path: Path, capsys) -> None:
    saved = tmp_path / "result.json"
    argv = [
        "bench", "--base-url", server.url, "--dataset-name", "random",
        "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(NUM_PROMPTS), "--ignore-eos", "--goodput", "e2el:60000",
        "--disable-tqdm", "--save-result", "--result-filename", str(saved),
    ]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err + server.log  # the `tandem` entry point
    assert "Failed requests:" + " " * 24 + "0" in capsys.readouterr().out

    record = read_like_vllm(saved)
    assert record["completed"] == NUM_PROMPTS and record["failed"] == 0
    assert record["errors"] == [""] * NUM_PROMPTS
    assert record["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # the server's usage, EOS ignored
    assert record["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert record["total_input_tokens"] == sum(record["input_lens"])
    assert all(abs(n - INPUT_LEN) <= 4 for n in record["input_lens"])  # counted by /tokenize
    assert all(text for text in record["generated_texts"])
    # Tokens that end inside a UTF-8 character arrive with the next chunk, so a request has at
    # most OUTPUT_LEN - 1 gaps; its E2EL is its TTFT plus its gaps.
    for ttft, gaps, e2el in zip(record["ttfts"], record["itls"], record["latencies"], strict=True):
        assert 0 < ttft <= e2el <= record["duration"]
        assert len(gaps) <= OUTPUT_LEN - 1
        assert ttft + sum(gaps) == pytest.approx(e2el)
    assert 0 < record["median_ttft_ms"] <= record["p99_ttft_ms"] <= 1000 * record["duration"]
    assert record["request_throughput"] == pytest.approx(NUM_PROMPTS / record["duration"])
    assert record["request_goodput"] == pytest.approx(record["request_throughput"])

    assert server.stop(SHUTDOWN_GRACE_S) == 0, server.log
    assert "Traceback" not in server.log
