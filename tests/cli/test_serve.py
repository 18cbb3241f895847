"""`tandem serve`: its flags, the backend they build, and a real process that drains and exits 0
on SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import re
import signal
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from cli.errors import CliError
from cli.main import build_parser
from cli.serve import deploy_config, engine_config, format_size, parse_size, server_settings
from coordinator.api.settings import ServerSettings
from coordinator.deploy import MODES, DeployConfig
from engine.config import EngineConfig
from kvtransfer.names import TRANSPORT_NAMES
from loadtest.serve_process import ServeProcess
from protocol.kv import DTYPE_BYTES

FLAGS = [
    "--model", "--served-model-name", "--host", "--port", "--address", "--mode",
    "--prefill-workers", "--decode-workers", "--dtype", "--device", "--block-size",
    "--kv-cache-memory", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
    "--local-prefill-threshold", "--kv-transport", "--api-key", "--max-queue",
    "--shutdown-grace", "--prefix-caching", "--seed", "--log-level", "--kv-checksum",
]  # fmt: skip
START_TIMEOUT_S = 120
REPO = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 30


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def serve_choices(flag: str) -> list[str]:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in commands.choices["serve"]._actions if flag in a.option_strings)
    return list(action.choices)


def test_help_lists_every_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        serve_args("--help")
    text = capsys.readouterr().out
    assert [flag for flag in FLAGS if flag not in text] == []


def test_defaults() -> None:
    args = serve_args()
    assert (args.host, args.port, args.mode) == ("127.0.0.1", 8000, "disaggregated")
    assert (args.prefill_workers, args.decode_workers) == (None, 1)
    assert args.kv_cache_memory == 2**30


def test_colocated_defaults_to_one_worker_unless_sizes_are_given() -> None:
    assert (deploy_config(serve_args()).num_prefill, deploy_config(serve_args()).num_decode) == (
        1,
        1,
    )
    colocated = deploy_config(serve_args("--mode", "colocated"))
    assert (colocated.num_prefill, colocated.num_decode) == (0, 1)
    sized = deploy_config(serve_args("--mode", "colocated", "--prefill-workers", "1"))
    assert sized.num_prefill + sized.num_decode == 2  # the pool: prefill + decode workers


def test_defaults_are_the_configs_defaults(tmp_path) -> None:
    args = serve_args("--model", str(tmp_path), "--device", "cpu")
    assert engine_config(args) == EngineConfig(model=tmp_path, device="cpu")
    assert deploy_config(args) == DeployConfig()
    assert args.max_queue == ServerSettings().max_queue


def test_every_kv_transport_choice_parses_and_is_registered() -> None:
    import kvtransfer.ipc  # noqa: F401  (registers ipc)
    import kvtransfer.torch_dist  # noqa: F401  (registers gloo and nccl)
    import kvtransfer.ucx  # noqa: F401  (registers ucx, ucx-shm, ucx-tcp; ucxx loads later)
    from kvtransfer.transport import TRANSPORTS

    choices = serve_choices("--kv-transport")
    assert choices == ["auto", *TRANSPORT_NAMES]
    assert sorted(TRANSPORTS) == sorted(TRANSPORT_NAMES)
    for choice in choices:
        assert deploy_config(serve_args("--kv-transport", choice)).kv_transport == choice


def test_unknown_kv_transport_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        serve_args("--kv-transport", "carrier-pigeon")
    assert "ucx-tcp" in capsys.readouterr().err


def test_dtype_and_mode_choices() -> None:
    assert serve_choices("--dtype") == list(DTYPE_BYTES) == ["bfloat16", "float16", "float32"]
    assert serve_choices("--mode") == list(MODES) == ["disaggregated", "colocated"]


def test_help_shows_the_kv_cache_default_as_a_size(capsys) -> None:
    with pytest.raises(SystemExit):
        serve_args("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "e.g. 512MiB or 4GiB (default: 1GiB)" in text


@pytest.mark.parametrize(
    "size,text", [(2**30, "1GiB"), (512 * 2**20, "512MiB"), (3 * 2**10, "3KiB"), (1000, "1000")]
)
def test_format_size(size, text) -> None:
    assert format_size(size) == text
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text,size",
    [
        ("1GiB", 2**30),
        ("512MiB", 512 * 2**20),
        ("2G", 2 * 10**9),
        ("1000", 1000),
        ("1.5Gi", 3 * 2**29),
    ],  # fmt: skip
)
def test_sizes(text, size) -> None:
    assert parse_size(text) == size


def test_bad_size_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        serve_args("--kv-cache-memory", "lots")
    assert "512MiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (a float overflow, once a traceback)
        serve_args("--kv-cache-memory", "9" * 400)
    assert "too large a size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "99999"], "--port must be in [0, 65535]"),
        (["--threads-per-worker", "-3"], "--threads-per-worker must be at least 1"),
        (["--kv-cache-memory", "0"], "--kv-cache-memory must be at least 1"),
        (["--max-model-len", "0"], "--max-model-len must be at least 1"),
        (["--kv-transfer-timeout", "nan"], "--kv-transfer-timeout must be a finite number > 0"),
        (["--placement-timeout", "-1"], "--placement-timeout must be a finite number > 0"),
        (["--shutdown-grace", "-5"], "--shutdown-grace must be a finite number >= 0"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ],
)
def test_flags_that_would_fail_after_startup_are_refused_before_it(flags, message) -> None:
    # (server_settings runs before Ray starts or a model loads)
    with pytest.raises(CliError, match=re.escape(message)):
        server_settings(serve_args(*flags))


def test_tool_call_and_cors_flags_reach_the_server_settings() -> None:
    assert server_settings(serve_args()).tool_call_parser is None
    assert server_settings(serve_args("--tool-call-parser", "hermes")).tool_call_parser is None
    both = serve_args("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert server_settings(both).tool_call_parser == "hermes"
    assert server_settings(serve_args()).allowed_origins == ("*",)
    assert server_settings(serve_args("--allowed-origins")).allowed_origins == ()
    narrow = serve_args("--allowed-origins", "http://a.example", "http://b.example")
    assert server_settings(narrow).allowed_origins == ("http://a.example", "http://b.example")


def test_flags_become_the_engine_and_deploy_configs(tiny_llama) -> None:
    args = serve_args(
        "--model", str(tiny_llama), "--served-model-name", "mine", "--dtype", "float32",
        "--block-size", "8", "--kv-cache-memory", "1MiB", "--max-num-seqs", "3",
        "--max-model-len", "256", "--no-prefix-caching", "--mode", "colocated",
        "--prefill-workers", "2", "--decode-workers", "3", "--kv-transport", "gloo",
        "--kv-transfer-timeout", "9", "--local-prefill-threshold", "64",
    )  # fmt: skip
    config = engine_config(args)
    assert (config.block_size, config.max_num_seqs, config.dtype) == (8, 3, "float32")
    assert config.kv_cache_memory_bytes == 2**20 and not config.enable_prefix_caching
    assert config.max_model_len == 256
    deploy = deploy_config(args)
    assert (deploy.mode, deploy.num_prefill, deploy.num_decode) == ("colocated", 2, 3)
    assert (deploy.kv_transport, deploy.transfer_timeout) == ("gloo", 9.0)
    assert (deploy.local_prefill_threshold, deploy.model_name) == (64, "mine")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_process_serves_then_exits_0_on_signal(tiny_llama, sig, tmp_path) -> None:
    args = [
        "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
        "--mode", "colocated", "--log-level", "warning",
    ]  # fmt: skip
    # Leaving the block kills whatever is left of the server and the Ray cluster it started.
    with ServeProcess(args, tmp_path / "serve.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        usage = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["usage"]
        assert usage["completion_tokens"] == 3
        returncode = server.stop(STOP_TIMEOUT_S, sig)
        output = server.output  # its stdout and stderr (where it logs)
    assert returncode == 0, output
    assert "Traceback" not in output


def _ours(server: ServeProcess) -> dict[int, str]:
    from coordinator.reaper import descendants

    return {pid: start for pid, start in descendants(server.process.pid).items()}


def _still_running(seen: dict[int, str]) -> list[int]:
    from coordinator.reaper import descendants

    alive = descendants(1)  # every process on the machine is a descendant of init
    return [pid for pid, start in seen.items() if alive.get(pid) == start]


def test_sigterm_while_starting_exits_and_leaves_nothing(tiny_llama, tmp_path) -> None:
    args = ["--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    with ServeProcess(args, tmp_path / "serve.log") as server:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any("WorkerActor" in _cmdline(pid) for pid in _ours(server)):
            assert time.monotonic() < deadline and server.process.poll() is None, server.log
            time.sleep(0.1)
        seen = _ours(server)  # the Ray cluster and the workers, loading their models
        returncode = server.stop(STOP_TIMEOUT_S, signal.SIGTERM)
        output = server.output
    assert returncode == 0, output
    assert "Traceback" not in output
    assert _wait_gone(seen, 15) == []


def test_a_killed_server_takes_its_ray_cluster_with_it(tiny_llama, tmp_path) -> None:
    args = ["--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    with ServeProcess(args, tmp_path / "serve.log") as server:
        server.wait_healthy(START_TIMEOUT_S)
        seen = _ours(server)
        assert any("WorkerActor" in _cmdline(pid) for pid in seen)
        server.process.kill()  # SIGKILL to the server alone, not its process group
        server.process.wait()
        assert _wait_gone(seen, 15) == []


def _wait_gone(seen: dict[int, str], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while _still_running(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [f"{pid} {_cmdline(pid)}" for pid in _still_running(seen)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_planner_flags_and_their_errors(tiny_llama, tmp_path) -> None:
    from coordinator.builder import planner_setup
    from engine.config import ConfigError

    profile = REPO / "benchmarks" / "profiles" / "smollm2-cpu-1thread.json"
    args = serve_args(
        "--model", str(tiny_llama), "--decode-workers", "2", "--planner", "dry-run",
        "--planner-slo", "ttft_p95=1s,itl_p95=80ms", "--planner-profile", str(profile),
        "--planner-max-workers", "5", "--planner-interval", "1.5",
    )  # fmt: skip
    deploy = deploy_config(args)
    setup = planner_setup(engine_config(args), deploy, tiny_llama)
    assert setup is not None and setup.settings.mode == "dry-run"
    assert (setup.settings.interval_s, setup.settings.percentile) == (1.5, 95.0)
    config = setup.planner.config
    assert (config.ttft_slo_s, config.itl_slo_s, config.max_workers) == (1.0, 0.08, 5)
    assert planner_setup(engine_config(args), DeployConfig(), tiny_llama) is None
    with pytest.raises(ConfigError, match="needs --planner-slo"):
        DeployConfig(planner="on")
    with pytest.raises(ConfigError, match="--mode disaggregated"):
        DeployConfig(mode="colocated", planner_slo="ttft_p99=1s,itl_p99=50ms")
    missing = DeployConfig(planner="on", planner_slo="ttft_p99=1s,itl_p99=50ms")
    with pytest.raises(ConfigError, match="tandem profile --model"):
        planner_setup(engine_config(args), missing, tmp_path)
    with pytest.raises(ConfigError, match="--planner-max-workers must be at least 2"):
        DeployConfig(planner_slo="ttft_p99=1s,itl_p99=50ms", planner_max_workers=0)
    with pytest.raises(ConfigError, match="--planner-interval must be a finite number > 0"):
        DeployConfig(planner_interval=float("nan"))  # (asyncio.sleep(nan) returns at once)
    with pytest.raises(ConfigError, match="below the 4 workers launched"):
        DeployConfig(num_prefill=2, num_decode=2, planner_max_workers=3)
    with pytest.raises(ConfigError, match="is a folder: name the profile's file"):
        planner_setup(engine_config(args), replace(missing, planner_profile=tmp_path), tmp_path)
    with pytest.raises(ConfigError, match="TTFT and an ITL"):
        planner_setup(engine_config(args), DeployConfig(planner_slo="ttft_p99=1s"), tiny_llama)
    assert serve_choices("--planner") == ["on", "dry-run", "off"]


def test_cost_routing_is_priced_from_the_models_step_profile(tmp_path) -> None:
    from coordinator.builder import route_costs
    from coordinator.router import RouteCosts
    from engine.config import ConfigError
    from planning.cost_model import StepCostModel

    profile = REPO / "benchmarks" / "profiles" / "smollm2-cpu-1thread.json"
    expected = RouteCosts.from_step_model(StepCostModel.load(profile))
    given = DeployConfig(routing="cost", planner_profile=profile)
    assert route_costs(given, tmp_path, "cpu") == expected != RouteCosts()
    (tmp_path / "tandem-profile.json").write_bytes(profile.read_bytes())
    assert route_costs(DeployConfig(routing="cost"), tmp_path, "cpu") == expected  # next to it
    assert route_costs(DeployConfig(routing="load"), tmp_path, "cpu") == RouteCosts()  # unpriced
    assert route_costs(DeployConfig(routing="cost"), tmp_path / "none", "cpu") == RouteCosts()
    # A CPU profile does not price GPU steps: the built-in prices stay.
    assert route_costs(DeployConfig(routing="cost"), tmp_path, "cuda") == RouteCosts()
    (tmp_path / "tandem-profile.json").write_text("{}")
    with pytest.raises(ConfigError, match="tandem-profile.json: not a"):
        route_costs(DeployConfig(routing="cost"), tmp_path, "cpu")


def test_the_planner_refuses_a_profile_of_another_device(tmp_path) -> None:
    import dataclasses

    from coordinator.builder import check_planner_profile, profile_mismatch
    from engine.config import ConfigError
    from planning.cost_model import StepCostModel

    cpu = StepCostModel.load(REPO / "benchmarks" / "profiles" / "smollm2-cpu-1thread.json")
    assert cpu.info.device == "cpu"
    deploy = DeployConfig(planner_profile=REPO / "benchmarks" / "profiles" / "x.json")
    check_planner_profile(cpu, "cpu", deploy, tmp_path)  # the same device: taken
    with pytest.raises(ConfigError, match="measured on cpu and the workers run on cuda") as err:
        check_planner_profile(cpu, "cuda", deploy, tmp_path)
    # The command names the model's folder, not the profile's.
    assert "--address auto" in str(err.value) and f"--model {tmp_path}`" in str(err.value)
    gpu = dataclasses.replace(cpu, info=dataclasses.replace(cpu.info, device="cuda:0"))
    assert profile_mismatch(gpu, "cuda") is None  # a device index does not matter
    assert "measured on cuda" in profile_mismatch(gpu, "cpu")
    fitted = dataclasses.replace(cpu, info=dataclasses.replace(cpu.info, device=""))
    assert profile_mismatch(fitted, "cuda") is None  # from telemetry: no device named


def test_stream_interval_flag_and_its_error(tiny_llama) -> None:
    from engine.config import ConfigError

    args = serve_args("--model", str(tiny_llama), "--stream-interval", "4")
    assert deploy_config(args).stream_interval == 4
    assert deploy_config(serve_args("--model", str(tiny_llama))).stream_interval == 1
    with pytest.raises(ConfigError, match="--stream-interval must be at least 1"):
        deploy_config(serve_args("--model", str(tiny_llama), "--stream-interval", "0"))
