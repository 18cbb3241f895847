"""benchmarks/serving.py without a server: the busy counter, the closed-loop driver, the summary
and table, the flags, and the overhead model driven in-process on a tiny tokenizer."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from loadtest.client import RequestResult
from loadtest.config import SamplingConfig
from loadtest.sample import SampleRequest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
_spec = importlib.util.spec_from_file_location("serving", SCRIPT)
serving = importlib.util.module_from_spec(_spec)
sys.modules["serving"] = serving  # dataclasses resolve their annotations through sys.modules
_spec.loader.exec_module(serving)

METRICS = """\
# HELP tandem:engine_busy_seconds Time the worker's engine thread spent inside step().
# TYPE tandem:engine_busy_seconds counter
tandem:engine_busy_seconds_total{model="m",pool="prefill",worker="prefill-0"} 1.5
tandem:engine_busy_seconds_total{model="m",pool="decode",worker="decode-0"} 10.0
# HELP tandem:kv_cache_usage_perc Fraction of KV blocks in use (1 = full).
# TYPE tandem:kv_cache_usage_perc gauge
tandem:kv_cache_usage_perc{model="m",pool="decode",worker="decode-0"} 0.25
# HELP tandem:kv_handover_seconds Prefill step's end to first token out.
# TYPE tandem:kv_handover_seconds histogram
tandem:kv_handover_seconds_bucket{le="0.1",model="m"} 3.0
tandem:kv_handover_seconds_bucket{le="+Inf",model="m"} 4.0
tandem:kv_handover_seconds_count{model="m"} 4.0
tandem:kv_handover_seconds_sum{model="m"} 0.2
# HELP tandem:kv_transfer_seconds Duration of one request's KV transfer.
# TYPE tandem:kv_transfer_seconds histogram
tandem:kv_transfer_seconds_bucket{le="+Inf",model="m",worker="prefill-0"} 1.0
tandem:kv_transfer_seconds_count{model="m",worker="prefill-0"} 1.0
tandem:kv_transfer_seconds_sum{model="m",worker="prefill-0"} 0.05
tandem:kv_transfer_seconds_bucket{le="+Inf",model="m",worker="prefill-1"} 3.0
tandem:kv_transfer_seconds_count{model="m",worker="prefill-1"} 3.0
tandem:kv_transfer_seconds_sum{model="m",worker="prefill-1"} 0.15
tandem:kv_transfer_seconds_bucket{le="+Inf",model="m",pool="decode",worker="decode-0"} 4.0
tandem:kv_transfer_seconds_count{model="m",pool="decode",worker="decode-0"} 4.0
tandem:kv_transfer_seconds_sum{model="m",pool="decode",worker="decode-0"} 0.9
"""


def make_round(tok_s: float, busy: dict[str, float] | None = None, failed: int = 0):
    return serving.Round(tok_s, 100.0, 200.0, 10.0, 20.0, 0.25, 64, 8, failed, 1.0, busy, None)


def test_scrape_reads_the_busy_counter_of_every_worker_and_the_span_histograms() -> None:
    counters = serving.scrape(METRICS)
    assert counters.busy == {"prefill-0": 1.5, "decode-0": 10.0}
    # the decode worker's view of the same transfers is left out
    assert counters.spans == {"handover": (0.2, 4.0), "transfer": (0.2, 4.0), "exposed": (0, 0)}
    assert serving.scrape("").busy == {}


def test_span_means_are_each_histograms_mean_over_the_window_in_ms() -> None:
    before = serving.Counters({}, {"handover": (0.2, 4.0), "transfer": (0.2, 4.0)})
    after = serving.Counters({}, {"handover": (0.5, 10.0), "transfer": (0.2, 4.0)})
    assert serving.span_means(before, after) == pytest.approx({"handover": 50.0})
    assert serving.span_means(before, before) is None  # nothing counted in the window
    assert serving.span_means(None, after) is None


def test_busy_fractions_divide_each_workers_increase_by_the_wall_time() -> None:
    before = {"decode-0": 10.0, "prefill-0": 1.5, "gone-0": 3.0}
    after = {"decode-0": 18.0, "prefill-0": 2.5, "new-0": 1.0}
    assert serving.busy_fractions(before, after, 10.0) == {"decode-0": 0.8, "prefill-0": 0.1}
    assert serving.busy_fractions({"decode-0": 5.0}, {"decode-0": 1.0}, 10.0) is None  # restarted
    assert serving.busy_fractions(None, after, 10.0) is None


def test_drive_keeps_concurrency_streams_busy_until_every_sample_is_sent() -> None:
    samples = [SampleRequest(f"p{i}", 1, 4) for i in range(7)]
    in_flight, peak, order = 0, 0, []

    async def send(sample: SampleRequest) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        order.append(sample.prompt)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestResult(1, 0.0, 0.01, (), 0.01, 4, "text", None)

    results, wall_s = asyncio.run(serving.drive(send, samples, concurrency=3))
    assert len(results) == 7 and peak == 3 and wall_s > 0
    assert order == [s.prompt for s in samples]  # sent in order, each once
    _, _ = asyncio.run(serving.drive(send, samples[:2], concurrency=5))
    assert peak == 3  # never more streams than samples


def test_joined_share_counts_the_tokens_that_came_in_a_chunk_with_others() -> None:
    alone = RequestResult(1, 0.0, 0.01, (0.01,) * 7, 0.08, 8, "t" * 8, None)  # 8 chunks
    pairs = RequestResult(1, 0.0, 0.01, (0.02,) * 3, 0.07, 8, "t" * 8, None)  # 4 chunks
    failed = RequestResult(1, 0.0, None, (), None, None, "", "timed out")
    assert serving.joined_share([alone]) == 0.0
    assert serving.joined_share([pairs]) == 0.5
    assert serving.joined_share([alone, pairs, failed]) == pytest.approx(4 / 16)
    assert serving.joined_share([failed]) == 0.0


def test_summary_takes_medians_over_rounds_and_the_ratio_to_in_process() -> None:
    inprocess = [make_round(100.0), make_round(120.0), make_round(110.0)]
    served = [make_round(50.0, {"d": 0.4}), make_round(66.0, {"d": 0.6}), make_round(55.0)]
    s = serving.summarize(served, inprocess)
    assert (s["output_tok_s"], s["output_tok_s_min"], s["output_tok_s_max"]) == (55.0, 50.0, 66.0)
    assert s["vs_inprocess"] == pytest.approx(0.5)
    assert s["busy"] == {"d": pytest.approx(0.5)} and s["rounds"] == 3
    assert serving.summarize(served, None)["vs_inprocess"] is None


def test_table_lists_rows_in_target_order_with_dashes_for_unknowns() -> None:
    results = serving.Results()
    results.rounds[("overhead", 16, "colocated")] = [make_round(60.0, {"colocated-0": 0.5})]
    results.rounds[("overhead", 16, "inprocess")] = [make_round(120.0, {"engine": 0.98})]
    results.rounds[("overhead", 16, "vllm")] = [make_round(90.0, failed=2)]
    table = serving.format_table(serving.summaries(results), ["inprocess", "colocated", "vllm"])
    lines = table.splitlines()
    assert "inprocess" in lines[1] and "colocated" in lines[2] and "vllm" in lines[3]
    assert "0.50x" in lines[2] and "colocated-0 50%" in lines[2]
    assert lines[3].split("|")[-2].strip() == "-" and lines[3].split("|")[-1].strip() == "2"
    saved = serving.report_json(results, serving.summaries(results), {"rounds": 1})
    assert json.loads(json.dumps(saved))["rows"][0]["per_round"][0]["output_tok_s"] == 60.0


def test_flags() -> None:
    quick = serving.parse_args(["--quick"])
    assert (quick.models, quick.concurrency, quick.rounds) == (["overhead"], [16], 1)
    full = serving.parse_args([])
    assert full.targets == ["inprocess", "colocated", "1p1d"] and full.num_prompts is None
    peer = serving.parse_args(["--models", "overhead", "--peer", "vllm=http://127.0.0.1:8100/"])
    assert peer.peers == {"vllm": "http://127.0.0.1:8100"}
    for bad in ("vllm=http://10.0.0.1:8100", "http://127.0.0.1:8100", "1p1d=http://127.0.0.1:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            serving.parse_peer(bad)
    with pytest.raises(SystemExit):  # a peer serves one model
        serving.parse_args(["--peer", "vllm=http://127.0.0.1:8100"])
    # One token budget for every engine, in-process and served.
    budget = serving.parse_args(["--max-num-batched-tokens", "512"])
    assert serving.engine_config(Path("m"), budget).max_num_batched_tokens == 512
    flags = serving.serve_args(Path("m"), "colocated", budget)
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "512"
    assert full.max_num_batched_tokens == 256  # EngineConfig's on a CPU
    with pytest.raises(SystemExit):
        serving.parse_args(["--max-num-batched-tokens", "0"])
    # The engines' device, resolved as tandem serve resolves it, and passed on to it.
    assert serving.device(full) == "cpu"  # no CUDA here
    gpu = serving.parse_args(["--device", "cuda", "--models", "gpu-0.5b", "--source", "src"])
    assert serving.engine_config(Path("m"), gpu).device == "cuda"
    flags = serving.serve_args(Path("m"), "colocated", gpu)
    assert flags[flags.index("--device") + 1] == "cuda"
    assert gpu.models == ["gpu-0.5b"] and gpu.source == Path("src")
    assert "--gpus-per-worker" not in flags  # tandem serve's default: a GPU each
    shared = serving.parse_args(["--device", "cuda", "--gpus-per-worker", "0.5"])
    flags = serving.serve_args(Path("m"), "1p1d", shared)
    assert flags[flags.index("--gpus-per-worker") + 1] == "0.5"
    assert full.models == ["smollm2", "overhead"]
    assert (full.temperature, full.top_p) == (0.0, None)  # greedy unless asked
    sampled = serving.parse_args(["--temperature", "1", "--top-p", "0.9"])
    assert (sampled.temperature, sampled.top_p) == (1.0, 0.9)


def test_overhead_model_streams_every_token_in_process(tiny_llama: Path, tmp_path: Path) -> None:
    from engine.config import ModelConfig

    folder = serving.write_random_model(tiny_llama, tmp_path / "overhead")
    config = ModelConfig.from_pretrained(folder)
    dims = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads)
    assert dims == (2, 256, 4, 2) and config.head_dim == 64
    assert (folder / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()

    args = serving.parse_args(
        ["--concurrency", "2", "--num-prompts", "4", "--input-len", "12", "--output-len", "8",
         "--dtype", "float32", "--kv-cache-memory", str(8 << 20)]
    )  # fmt: skip
    rounds = serving.engine_session(folder, serving.make_workload(folder, args), args)
    measured = rounds[2]
    assert (measured.completed, measured.failed, measured.output_tokens) == (4, 0, 4 * 8)
    assert measured.output_tok_s > 0 and measured.ttft_p50_ms > 0 and measured.itl_p50_ms > 0
    assert 0 < measured.busy["engine"] <= 1.0


def test_the_stepped_engine_serves_the_same_requests(tiny_llama: Path) -> None:
    args = serving.parse_args(
        ["--concurrency", "2", "--num-prompts", "5", "--input-len", "12", "--output-len", "8",
         "--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--targets", "stepped"]
    )  # fmt: skip
    rounds = serving.run_session(
        "stepped", tiny_llama, serving.make_workload(tiny_llama, args), args, Path()
    )
    measured = rounds[2]
    assert (measured.completed, measured.failed, measured.output_tokens) == (5, 0, 5 * 8)
    assert measured.output_tok_s > 0 and measured.ttft_p50_ms > 0 and measured.itl_p50_ms > 0
    assert 0 < measured.busy["engine"] <= 1.0


class WordCounter:
    def count(self, text: str) -> int:
        return len(text.split())


def test_http_session_times_a_server_without_busy_counter(serve, monkeypatch) -> None:
    monkeypatch.setattr(serving, "STATS_SETTLE_S", 0.0)
    server = serve(ttft_s=0.05, itl_s=0.01)
    samples = [SampleRequest(f"word{i} and more", 3, 6) for i in range(8)]
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, ignore_eos=True)
    workload = serving.Workload(samples, WordCounter(), None, sampling)
    args = serving.parse_args(["--models", "overhead", "--concurrency", "2", "4"])
    rounds = serving.http_session(server.url, workload, args)

    assert sorted(rounds) == [2, 4]
    for concurrency, measured in rounds.items():
        assert (measured.completed, measured.failed) == (2 * concurrency, 0)
        assert measured.output_tokens == 2 * concurrency * 6
        assert measured.ttft_p50_ms == pytest.approx(50.0, abs=30.0)
        assert measured.itl_p50_ms == pytest.approx(10.0, abs=8.0)
        assert measured.busy is None  # the fake server has no /metrics
    sent = server.received[serving.WARMUP_REQUESTS :]
    assert all(p["ignore_eos"] and p["stream"] for p in sent)
    assert all(p["temperature"] == 0.7 and p["top_p"] == 0.9 for p in sent)
