"""A `vllm bench serve` command line, verbatim, run as `tandem bench` through the real entry point:
vLLM's flags, its default result file name and its JSON keys; vLLM's flags tandem cannot honour
end with one line naming them."""

from __future__ import annotations

import json
import re
import shlex
import socket
from pathlib import Path

import httpx
import pytest

from cli import main as cli
from loadtest.config import ResultFile, TargetConfig
from loadtest.results import default_result_filename, result_path
from loadtest.target import build_target, request_headers, resolve_model

MODEL = "fake-model"  # the fake server's
VLLM_COMMAND = (
    "--backend vllm --model {model} --base-url {url} --dataset-name random "
    "--random-input-len 32 --random-output-len 8 --num-prompts 8 --max-concurrency 4 "
    "--request-rate inf --ignore-eos --percentile-metrics ttft,tpot,itl,e2el "
    "--metric-percentiles 50,99 --goodput ttft:500 tpot:50 --save-result --result-dir {out}"
)
# What `vllm bench serve --save-result` writes for a generation run (vllm/benchmarks/serve.py).
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
    "latencies", "start_times", "generated_texts", "errors", "max_output_tokens_per_s",
    "max_concurrent_requests",
    *(
        f"{stat}_{metric}_ms"
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "std", "p50", "p99")
    ),
}  # fmt: skip
DATE = r"\d{8}-\d{6}"


def tandem_bench(command: str, capsys) -> tuple[int, str, str]:
    status = cli.main(["bench", "--disable-tqdm", *shlex.split(command)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err.strip()


def only_file(folder: Path) -> Path:
    files = list(folder.iterdir())
    assert len(files) == 1, files
    return files[0]


def test_vllm_command_line_verbatim(serve, tmp_path: Path, capsys) -> None:
    server = serve(ttft_s=0.01, itl_s=0.005)
    command = VLLM_COMMAND.format(model=MODEL, url=server.url, out=tmp_path / "results")
    status, out, err = tandem_bench(command, capsys)
    assert (status, err) == (0, "")

    saved = only_file(tmp_path / "results")
    assert re.fullmatch(rf"vllm-infqps-concurrency4-{MODEL}-{DATE}\.json", saved.name)
    assert f"Results saved to {saved}" in out
    record = json.loads(saved.read_text())
    assert record.keys() >= VLLM_KEYS
    assert saved.name.endswith(f"-{record['date']}.json")
    assert (record["backend"], record["endpoint_type"], record["model_id"]) == (
        "vllm",
        "vllm",
        MODEL,
    )
    assert (record["request_rate"], record["max_concurrency"], record["num_prompts"]) == (
        "inf",
        4,
        8,
    )
    assert (record["completed"], record["failed"]) == (8, 0)
    assert record["output_lens"] == [8] * 8 and record["input_lens"] == [32] * 8
    assert record["latencies"] == record["e2els"]
    assert record["request_goodput"] == pytest.approx(record["request_throughput"])
    assert 1 <= record["peak_concurrent_requests"] <= 4
    # vLLM's count: requests active within one whole second (here all 8 of them).
    assert record["peak_concurrent_requests"] <= record["max_concurrent_requests"] <= 8
    assert all(p["ignore_eos"] and p["max_tokens"] == 8 for p in server.received)
    assert server.max_in_flight <= 4


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        ("--result-filename run.json", r"run\.json"),
        ("--label mine --request-rate 50", rf"mine-50\.0qps-{MODEL}-{DATE}\.json"),
        (
            "--max-concurrency 2 --backend openai",
            rf"openai-infqps-concurrency2-{MODEL}-{DATE}\.json",
        ),  # noqa: E501
    ],
)
def test_result_file_names(serve, tmp_path: Path, capsys, flags: str, name: str) -> None:
    server = serve(ttft_s=0.01, itl_s=0.005)
    command = f"--base-url {server.url} --random-input-len 4 --random-output-len 2 "
    command += f"--num-prompts 2 --save-result --result-dir {tmp_path} {flags}"
    assert tandem_bench(command, capsys)[0] == 0
    assert re.fullmatch(name, only_file(tmp_path).name)


def test_result_dir_without_save_result_saves_nothing(serve, tmp_path: Path, capsys) -> None:
    server = serve(ttft_s=0.01, itl_s=0.005)
    command = f"--base-url {server.url} --random-input-len 4 --random-output-len 2 "
    command += f"--num-prompts 2 --result-dir {tmp_path} --result-filename r.json"
    assert tandem_bench(command, capsys)[0] == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["prefix_repetition", "prefix-repetition"])
def test_prefix_repetition_dataset(serve, tmp_path: Path, capsys, name: str) -> None:
    server = serve(ttft_s=0.01, itl_s=0.005)
    command = (
        f"--base-url {server.url} --dataset-name {name} --prefix-repetition-prefix-len 6 "
        "--prefix-repetition-suffix-len 3 --prefix-repetition-num-prefixes 2 "
        f"--prefix-repetition-output-len 4 --num-prompts 6 --save-result --result-dir {tmp_path}"
    )
    status, _, err = tandem_bench(command, capsys)
    assert (status, err) == (0, "")
    record = json.loads(only_file(tmp_path).read_text())
    assert record["dataset_name"] == "prefix_repetition"
    assert record["input_lens"] == [9] * 6 and record["output_lens"] == [4] * 6
    prompts = [payload["prompt"] for payload in server.received[1:]]  # after the probe
    prefixes = {" ".join(prompt.split()[:6]) for prompt in prompts}
    assert len(prefixes) == 2 and len(set(prompts)) == 6


def test_host_port_backend_chat_and_request_fields(serve, capsys, tmp_path: Path) -> None:
    server = serve(ttft_s=0.01, itl_s=0.005)
    port = server.url.rsplit(":", 1)[1]
    command = (
        f"--host 127.0.0.1 --port {port} --backend openai-chat --endpoint /v1/chat/completions "
        f"--model org/{MODEL} --served-model-name {MODEL} --input-len 5 --output-len 3 "
        "--num-prompts 2 --min-p 0.1 --extra-body '{\"min_tokens\": 2}' --metadata run=7 "
        f"--percentile-metrics ttft --result-path {tmp_path / 'r.json'}"
    )
    status, out, err = tandem_bench(command, capsys)
    assert (status, err) == (0, "")
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["backend"] == "openai-chat" and record["model_id"] == f"org/{MODEL}"
    assert record["run"] == "7"  # --metadata
    assert record["input_lens"] == [5, 5] and record["output_lens"] == [3, 3]
    payload = server.received[-1]
    assert (payload["model"], payload["min_p"], payload["min_tokens"]) == (MODEL, 0.1, 2)
    assert "messages" in payload
    assert "Time to First Token" in out and "Inter-token Latency" not in out


def test_header_overrides_api_key() -> None:
    headers = (("Authorization", "x"), ("a", "b"))
    config = TargetConfig("http://h", "/v1/completions", None, "key", 1.0, headers=headers)
    assert request_headers(config) == {"Authorization": "x", "a": "b"}


@pytest.mark.parametrize(
    "base_url,endpoint,url",
    [
        ("http://h:8000/v1", "/v1/completions", "http://h:8000/v1/completions"),
        ("http://h:8000/v1/", "/v1/chat/completions", "http://h:8000/v1/chat/completions"),
        ("http://h:8000/", "/v1/completions", "http://h:8000/v1/completions"),
        ("http://h:8000/v1", "/generate", "http://h:8000/v1/generate"),  # no /v1 to join
    ],
)
def test_an_openai_sdk_base_url_does_not_double_v1(base_url, endpoint, url) -> None:
    config = TargetConfig(base_url, endpoint, "m", None, 1.0)
    assert build_target(config, "m").url == url
    asked = []

    def models(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return httpx.Response(200, json={"data": [{"id": "served"}]})

    unnamed = TargetConfig(base_url, endpoint, None, None, 1.0)
    with httpx.Client(transport=httpx.MockTransport(models)) as client:
        assert resolve_model(client, unnamed) == "served"
    assert asked == ["http://h:8000/v1/models"]


@pytest.fixture
def closed_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


UNSUPPORTED = "is not supported by tandem bench"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--profile", f"--profile {UNSUPPORTED}: tandem bench drives no server profiler"),
        (
            "--ramp-up-strategy linear --ramp-up-start-rps 1 --ramp-up-end-rps 4",
            f"--ramp-up-strategy linear {UNSUPPORTED}: "
            "use --sweep request-rate=R1,R2,... for load steps",
        ),
        (
            "--lora-modules a b",
            f"--lora-modules a b {UNSUPPORTED}: tandem bench sends no LoRA requests",
        ),
        (
            "--ready-check-timeout-sec 600",
            f"--ready-check-timeout-sec 600 {UNSUPPORTED}: "
            "tandem bench probes the server once; start it first",
        ),
        (
            "--dataset-name hf",
            f"--dataset-name hf {UNSUPPORTED} (it has random, sharegpt, prefix_repetition, mixed)",
        ),
        ("--backend tgi", f"--backend tgi {UNSUPPORTED} (it sends openai, openai-chat, vllm)"),
        (
            "--backend openai-chat",
            "--backend openai-chat sends chat requests, but --endpoint /v1/completions is not "
            "a chat endpoint (use --endpoint /v1/chat/completions)",
        ),
        (
            "--percentile-metrics ttft,client_queue_time",
            "--percentile-metrics 'ttft,client_queue_time': 'client_queue_time' is not one "
            "tandem measures (ttft, tpot, itl, e2el)",
        ),
        (
            "--dataset-path d.json",
            "--dataset-path is read by --dataset-name sharegpt only, not random",
        ),
        ("--extra-body [1]", "--extra-body '[1]' is not a JSON object"),
    ],
)
def test_unhonoured_vllm_flags_are_refused(closed_url: str, capsys, flags: str, message: str):
    status, _, err = tandem_bench(f"--base-url {closed_url} {flags}", capsys)
    assert (status, err) == (1, f"tandem bench: error: {message}")


def test_flags_at_values_that_change_nothing_pass(serve, capsys) -> None:
    server = serve(ttft_s=0.01, itl_s=0.005)
    command = (
        f"--base-url {server.url} --num-prompts 1 --random-input-len 2 --random-output-len 2 "
        "--ready-check-timeout-sec 0 --tokenizer-mode auto --save-detailed --no-stream "
        "--trust-remote-code --random-batch-size 1"
    )
    assert tandem_bench(command, capsys)[:3:2] == (0, "")


RUN = {"label": None, "backend": "openai", "request_rate": 4.0, "max_concurrency": None}
RUN |= {"model_id": "org/Llama-3", "date": "20250102-030405"}
BUSY_RUN = RUN | {"request_rate": "inf", "max_concurrency": 8, "label": "a"}
SWEEP = {"sweep": {"parameter": "request-rate"}, "runs": [RUN]}


@pytest.mark.parametrize(
    ("record", "name"),
    [
        (RUN, "openai-4.0qps-Llama-3-20250102-030405.json"),
        (BUSY_RUN, "a-infqps-concurrency8-Llama-3-20250102-030405.json"),
        (SWEEP, "openai-sweep-request-rate-Llama-3-20250102-030405.json"),
    ],
)
def test_default_result_filename(record: dict, name: str) -> None:
    assert default_result_filename(record) == name
    assert result_path(ResultFile(Path("out")), record) == Path("out") / name
    assert result_path(ResultFile(filename="x/r.json"), record) == Path("x/r.json")


def test_save_result_is_a_switch_and_names_result_path(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--save-result", "out/run.json"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "tandem bench: error: --save-result is a switch, as in vLLM; "
        "save to a path with --result-path out/run.json"
    )
