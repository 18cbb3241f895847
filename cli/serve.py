"""`tandem serve`: the OpenAI-compatible HTTP endpoint in front of the engine pools.

Flags map to an `EngineConfig` (per worker), `ServerSettings` (HTTP) and a `DeployConfig` (the
cluster layout), and take their defaults from those dataclasses; `make_client` is the one place
that turns them into a backend. Everything imported at the top is torch-free and Ray-free: the
CLI imports this module for `--help`, and torch and Ray load only when serving.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.defaults import DEVICES, add_gpu_memory_flag, add_tensor_parallel_flag, default_of
from cli.errors import CliError
from coordinator.api.settings import TOOL_CALL_PARSERS, ServerSettings
from coordinator.deploy import MODES, PLANNER_MODES, ROUTING_POLICIES, DeployConfig
from engine.config import EngineConfig
from kvtransfer.names import TRANSPORT_NAMES
from loadtest.cli import DefaultsFormatter
from planning.model_file import PROFILE_FILE
from protocol.kv import DTYPE_BYTES

if TYPE_CHECKING:
    from coordinator.api.client import EngineClient

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_GRACE_S = 30.0
SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
KV_TRANSPORT_CHOICES = ("auto", *TRANSPORT_NAMES)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /ready, /metrics).",
        formatter_class=DefaultsFormatter,
    )
    _add_http_flags(p.add_argument_group("HTTP"))
    _add_model_flags(p.add_argument_group("model and engine (per worker)"))
    _add_cluster_flags(p.add_argument_group("cluster"))
    _add_planner_flags(p.add_argument_group("SLO planner (sets the prefill/decode split)"))
    p.set_defaults(run=run)


def _add_http_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    g.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="require 'Authorization: Bearer KEY' (except /health, /ready, /metrics); "
        "default: $TANDEM_API_KEY, else no key",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat requests with tools use tool_choice "auto" (needs --tool-call-parser)',
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls: hermes, <tool_call>{json}</tool_call> (Qwen2.5+)",
    )
    g.add_argument(
        "--allowed-origins",
        nargs="*",
        default=["*"],
        metavar="ORIGIN",
        help="browser origins allowed to call the API (CORS); default * (any); none: no CORS",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=_deploy("stream_interval"),
        metavar="N",
        help="streamed tokens per chunk (the first and the last are sent at once): more costs "
        "the server less per token, and makes streams burstier",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=default_of(ServerSettings, "max_queue"),
        help="sequences (prompts x n) admitted but without output yet; more get 503 with "
        "Retry-After",
    )
    g.add_argument(
        "--max-prompts",
        type=int,
        default=default_of(ServerSettings, "max_prompts"),
        help="prompts one completions request may list; more get 400",
    )
    g.add_argument(
        "--max-n",
        type=int,
        default=default_of(ServerSettings, "max_n"),
        help="choices (n) one request may ask for; more get 400",
    )
    g.add_argument(
        "--max-body-size",
        type=parse_size,
        default=default_of(ServerSettings, "max_body_bytes"),
        metavar="BYTES",
        help="request bodies over this get 413 "
        f"(default: {format_size(default_of(ServerSettings, 'max_body_bytes'))})",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds requests in flight get to finish",
    )
    g.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="logs"
    )


def _add_model_flags(g: argparse._ArgumentGroup) -> None:
    def engine(name: str) -> Any:
        return default_of(EngineConfig, name)

    g.add_argument("--model", type=Path, help="model folder (default: the fetched default model)")
    g.add_argument("--served-model-name", help="model id clients use (default: folder name)")
    g.add_argument("--dtype", default=engine("dtype"), choices=list(DTYPE_BYTES), help="weights")
    g.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="auto: cuda if the Ray cluster has GPUs",
    )
    g.add_argument(
        "--block-size", type=int, default=engine("block_size"), help="tokens per KV block"
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=engine("kv_cache_memory_bytes"),
        metavar="BYTES",
        help="KV cache per worker, e.g. 512MiB or 4GiB "
        f"(default: {format_size(engine('kv_cache_memory_bytes'))})",
    )
    add_gpu_memory_flag(
        g,
        "CUDA: the share of a GPU's memory each worker may hold (weights, activations, KV); "
        "its KV cache gets the rest, instead of --kv-cache-memory. Workers sharing a GPU "
        "(--gpus-per-worker 0.5) each take their own share: 0.45 for two",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=engine("max_num_seqs"),
        help="running requests per worker",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=engine("max_num_batched_tokens"),
        help="tokens per engine step (default: 2048 on a GPU, 256 on a CPU)",
    )
    g.add_argument(
        "--decode-headroom-tokens",
        type=int,
        default=engine("decode_headroom_tokens"),
        metavar="N",
        help="a decode worker takes new KV only while every request it holds can still grow by "
        "N tokens (fewer near max_tokens) without preempting one",
    )
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=engine("enable_prefix_caching"),
        help="reuse KV",
    )
    g.add_argument(
        "--share-prefill",
        action=argparse.BooleanOptionalAction,
        default=engine("share_prefill"),
        help="a request whose next prompt block another request is prefilling waits for it to "
        "be cached instead of computing it too (the n choices of one prompt, a shared system "
        "prompt)",
    )
    g.add_argument("--seed", type=int, default=engine("seed"), help="seeds unseeded sampling")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every decode step eagerly instead of replaying CUDA graphs",
    )
    add_tensor_parallel_flag(
        g, "ranks each worker's model is split across: GPUs, or CPU cores (one per rank)"
    )


def _deploy(name: str) -> Any:
    """A DeployConfig field's default, for the flag that sets it."""
    return default_of(DeployConfig, name)


def _add_cluster_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--mode",
        default=_deploy("mode"),
        choices=MODES,
        help="separate prefill and decode pools, or one pool doing both",
    )
    g.add_argument(
        "--address", help="Ray cluster to join ('auto' on a head node; default: start one)"
    )
    g.add_argument(
        "--prefill-workers",
        type=int,
        help=f"prefill pool size (default: {_deploy('num_prefill')}; in colocated mode 0, so the "
        "pool is one worker with every core, unless set: then the pool is prefill + decode)",
    )
    g.add_argument(
        "--decode-workers",
        type=int,
        default=_deploy("num_decode"),
        help="decode (or colocated) pool size",
    )
    g.add_argument(
        "--prefill-tp",
        type=int,
        metavar="N",
        help="tensor parallel size of prefill workers (default: --tensor-parallel-size)",
    )
    g.add_argument(
        "--decode-tp",
        type=int,
        metavar="N",
        help="tensor parallel size of decode (or colocated) workers (default: "
        "--tensor-parallel-size)",
    )
    g.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=_deploy("local_prefill_threshold"),
        metavar="TOKENS",
        help="with --routing load: prompts with fewer uncached tokens are prefilled on the "
        "decode worker; 0: never",
    )
    g.add_argument(
        "--routing",
        default=_deploy("routing"),
        choices=ROUTING_POLICIES,
        help="cost: cheapest predicted prefill work, using each worker's reported prefix cache; "
        "load: least loaded workers; round-robin",
    )
    g.add_argument(
        "--kv-transport",
        default=_deploy("kv_transport"),
        choices=KV_TRANSPORT_CHOICES,
        help="how KV moves between workers; auto: gloo on CPU, on GPUs CUDA IPC between "
        "workers sharing one and NCCL between GPUs",
    )
    g.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=_deploy("transfer_timeout"),
        metavar="SECONDS",
        help="how long a decode worker holds blocks reserved for KV that has not arrived",
    )
    g.add_argument(
        "--kv-checksum",
        action=argparse.BooleanOptionalAction,
        default=_deploy("kv_checksum"),
        help="check every transferred layer's checksum before decoding from it",
    )
    g.add_argument(
        "--threads-per-worker",
        type=int,
        default=_deploy("threads_per_worker"),
        metavar="N",
        help="torch threads of each CPU worker (default: cores / workers; a decode worker: "
        "cores / decode workers, as decode uses the cores prefill leaves idle)",
    )
    g.add_argument(
        "--lend-cores",
        action=argparse.BooleanOptionalAction,
        default=_deploy("lend_cores"),
        help="with the default thread split on CPU, a worker steps on every core while the "
        "others on its host are idle, and on its share while they compute "
        "(kernels/core_share.py)",
    )
    g.add_argument(
        "--gpus-per-worker",
        type=float,
        default=_deploy("gpus_per_worker"),
        metavar="FRACTION",
        help="each rank's share of a GPU with --device cuda (default 1; 0.5 puts a prefill and "
        "a decode worker on one GPU, their KV moving through host memory over gloo)",
    )
    g.add_argument(
        "--placement-timeout",
        type=float,
        default=_deploy("placement_timeout"),
        metavar="SECONDS",
        help="fail the start when Ray has not placed every worker by then (raise it while an "
        "autoscaler adds nodes)",
    )


def _add_planner_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--planner",
        default=_deploy("planner"),
        choices=PLANNER_MODES,
        help="on: switch roles, grow and shrink the pools to keep --planner-slo; dry-run: "
        "only recommend (GET /admin/planner, /metrics); off: neither (POST /admin/planner "
        "changes the mode while serving)",
    )
    g.add_argument(
        "--planner-slo",
        metavar="SLO",
        help="the TTFT and ITL limits to keep, e.g. ttft_p99=2s,itl_p99=50ms",
    )
    g.add_argument(
        "--planner-profile",
        type=Path,
        metavar="FILE",
        help=f"step cost model from tandem profile (default: <model>/{PROFILE_FILE})",
    )
    g.add_argument(
        "--planner-max-workers",
        type=int,
        metavar="N",
        help="the planner never grows past N workers (default: the workers launched)",
    )
    g.add_argument(
        "--planner-interval",
        type=float,
        default=_deploy("planner_interval"),
        metavar="SECONDS",
        help="time between decisions",
    )


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '2G', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 512MiB or 4GiB")
    size = float(match.group(1)) * SIZE_UNITS[(match.group(2) or "").lower()]
    if not size < 2**63:  # (a 400-digit number is inf as a float)
        raise argparse.ArgumentTypeError(f"{text!r} is too large a size")
    return int(size)


def format_size(num_bytes: int) -> str:
    """2**30 -> '1GiB': the largest binary unit that divides it exactly, else bytes."""
    for unit in ("Gi", "Mi", "Ki"):
        scale = int(SIZE_UNITS[unit.lower()])
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}B"
    return str(num_bytes)


def run(args: argparse.Namespace) -> int:
    from coordinator.api.server import StartupInterrupted, interrupt

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    settings = server_settings(args)
    signal.signal(signal.SIGTERM, interrupt)  # until uvicorn takes the signals over
    try:
        return _serve(args, settings)
    except (StartupInterrupted, KeyboardInterrupt) as err:
        log.info("stopped by %s before serving", err or "SIGINT")
        _stop_ray()
        return 0


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The HTTP server's settings; refuses, before Ray or a model starts, flags that would
    only fail once they had (a port past 65535, a negative thread count, a zero KV cache)."""
    for flag in ("max_queue", "max_prompts", "max_n", "max_body_size", "kv_cache_memory"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("max_model_len", "threads_per_worker"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], not {args.port}")
    for flag in ("kv_transfer_timeout", "placement_timeout"):
        if not 0 < getattr(args, flag) < math.inf:  # (NaN fails too)
            raise CliError(f"--{flag.replace('_', '-')} must be a finite number > 0")
    if not 0 <= args.shutdown_grace < math.inf:
        raise CliError("--shutdown-grace must be a finite number >= 0")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CliError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return ServerSettings(
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_prompts=args.max_prompts,
        max_n=args.max_n,
        max_body_bytes=args.max_body_size,
        allowed_origins=tuple(args.allowed_origins),
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
    )


def _serve(args: argparse.Namespace, settings: ServerSettings) -> int:
    import uvicorn

    from coordinator.api.app import create_app
    from coordinator.api.server import CANCEL_AFTER_DRAIN_S, DrainingServer

    app = create_app(make_client(args), settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=CANCEL_AFTER_DRAIN_S,
    )
    server = DrainingServer(config, app.state.tandem.admission, args.shutdown_grace)
    server.run()
    if not server.started:
        raise CliError("the server did not start (see the log above)")
    return 0


def _stop_ray() -> None:
    """Stops the Ray cluster this process started (its workers with it), if it started one."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def make_client(args: argparse.Namespace) -> EngineClient:
    """The backend behind the HTTP app: prefill/decode pools (or colocated workers) on Ray."""
    from coordinator.builder import build_client

    deploy = deploy_config(args)
    log.info(
        "starting %s workers (%d prefill, %d decode), KV transport %s, Ray %s",
        deploy.mode, deploy.num_prefill, deploy.num_decode, deploy.kv_transport,
        deploy.address or "local",
    )  # fmt: skip
    return build_client(engine_config(args), deploy)


def deploy_config(args: argparse.Namespace) -> DeployConfig:
    """Where the workers run and how they talk, from the flags."""
    return DeployConfig(
        mode=args.mode,
        num_prefill=_prefill_workers(args),
        num_decode=args.decode_workers,
        address=args.address,
        kv_transport=args.kv_transport,
        transfer_timeout=args.kv_transfer_timeout,
        kv_checksum=args.kv_checksum,
        local_prefill_threshold=args.local_prefill_threshold,
        routing=args.routing,
        placement_timeout=args.placement_timeout,
        threads_per_worker=args.threads_per_worker,
        lend_cores=args.lend_cores,
        gpus_per_worker=args.gpus_per_worker,
        model_name=args.served_model_name,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        planner=args.planner,
        planner_slo=args.planner_slo,
        planner_profile=args.planner_profile,
        planner_max_workers=args.planner_max_workers,
        planner_interval=args.planner_interval,
        stream_interval=args.stream_interval,
    )


def _prefill_workers(args: argparse.Namespace) -> int:
    # One colocated worker with all the cores serves more than two with half each (measured in
    # benchmarks/serving.py; docs/performance.md).
    if args.prefill_workers is not None:
        return args.prefill_workers
    return 0 if args.mode == "colocated" else DeployConfig.num_prefill


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """One worker's engine settings, from the flags."""
    return EngineConfig(
        model=model_folder(args.model),
        dtype=args.dtype,
        device=args.device,  # "auto" is settled once Ray is up (coordinator.builder)
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_headroom_tokens=args.decode_headroom_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        share_prefill=args.share_prefill,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        cuda_graphs=not args.enforce_eager,
    )


def model_folder(model: Path | None) -> Path:
    if model is None:
        from engine.fetch import fetch_default_model

        return fetch_default_model(log=lambda line: log.info("%s", line))
    if not model.is_dir():
        raise CliError(f"model folder {model} does not exist")
    # Absolute: workers on other nodes open the same path, from another working directory.
    return model.resolve()
