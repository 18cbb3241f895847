"""`tandem simulate`: run a deployment in simulated time, against `tandem bench`'s workloads.

The workload flags are `tandem bench`'s own (dataset, lengths, rate, burstiness, concurrency,
percentiles, goodput, --save-result), so a real run and its simulation take one command line
apart from the first word; the result is the same JSON, for `tandem bench compare`. With
--tokenizer the prompts are the very ones `tandem bench` sends (so prefix sharing is exact);
without, lengths and sharing follow the dataset and token ids are made up. --trace replays a
JSON-lines trace instead (simulation/workload.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cli.defaults import default_of
from cli.errors import CliError
from coordinator.router import POLICIES, RouteCosts
from engine.config import EngineConfig, default_batched_tokens
from loadtest.cli import DefaultsFormatter, config_from_args
from loadtest.cli_flags import add_bench_flags
from planning.model_file import PROFILE_FILE

if TYPE_CHECKING:
    from loadtest.config import BenchConfig
    from planning.cost_model import StepCostModel
    from protocol.kv import KVLayout
    from simulation.deployment import Scenario
    from simulation.workload import SimRequest


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "simulate",
        help="simulate a deployment serving a workload (tandem bench's flags and JSON)",
        description="Simulate a deployment in simulated time: the real router and scheduler, "
        "engine steps timed by a `tandem profile` cost model. Takes tandem bench's workload "
        "flags and prints (and saves) the same result.",
        formatter_class=DefaultsFormatter,
    )
    add_deployment_flags(p)
    p.add_argument("--trace", type=Path, help="replay this JSON-lines trace instead of a dataset")
    p.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="WORKER@SECONDS",
        help="the worker (e.g. decode-0) dies at that time; repeatable",
    )
    p.add_argument(
        "--summary-only",
        action="store_true",
        help="leave the per-request lists of the saved JSON empty (long traces)",
    )
    add_bench_flags(p, taken=("--profile",))
    p.set_defaults(run=run)


def add_deployment_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment (as tandem serve takes it)")
    g.add_argument(
        "--profile", type=Path, help=f"step cost model (default: <model>/{PROFILE_FILE})"
    )
    g.add_argument(
        "--transfer-profile",
        type=Path,
        help="KV transfer cost model, from tandem profile --transport NAME (default: free)",
    )
    g.add_argument("--model-dir", type=Path, help="model folder: its KV size, its saved profile")
    g.add_argument("--mode", choices=("colocated", "disaggregated"), default="disaggregated")
    g.add_argument("--prefill-workers", type=int, default=1, metavar="N")
    g.add_argument("--decode-workers", type=int, default=1, metavar="N")
    g.add_argument("--routing", choices=POLICIES, default="load")
    g.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS")
    g.add_argument(
        "--num-kv-blocks", type=int, metavar="N", help="per worker (default: what 1 GiB holds)"
    )
    g.add_argument("--block-size", type=int, default=default_of(EngineConfig, "block_size"))
    g.add_argument("--max-num-seqs", type=int, default=default_of(EngineConfig, "max_num_seqs"))
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens per engine step (default: tandem serve's on the profile's device: 2048 on "
        "a GPU, 256 on a CPU; 2048 for a profile fitted from telemetry, which names no device)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--late-after-ms",
        type=float,
        help="the TTFT objective (tandem serve takes it from --planner-slo): a request waiting "
        "longer is late, and both the line for decode room and each worker's prompts waiting "
        "for prefill serve the newest first while their oldest is",
    )
    g.add_argument(
        "--decode-headroom-tokens",
        type=int,
        default=default_of(EngineConfig, "decode_headroom_tokens"),
        help="as tandem serve's",
    )
    g.add_argument(
        "--host-cores",
        type=float,
        metavar="N",
        help="CPU workers on one machine: the cores their single-thread engines share (a step "
        "runs k / N times slower while k workers step); default: a device per worker",
    )
    g.add_argument(
        "--paced-cores",
        type=int,
        metavar="N",
        help="CPU workers that pace N cores as tandem serve's do on a CPU host it splits: each "
        "step runs on N // (workers with work) threads, at the --thread-profile measured on that "
        "many (--profile where none was given), a step in progress re-paced when another "
        "worker starts or stops having work",
    )
    g.add_argument(
        "--thread-profile",
        action="append",
        default=[],
        metavar="T=PATH",
        help="with --paced-cores: the step profile measured on T threads (tandem profile "
        "--threads T); once per thread count",
    )
    g.add_argument(
        "--prefill-interference",
        type=float,
        default=1.0,
        metavar="X",
        help="CPU workers on one machine: a decode step that starts while a prefill worker is "
        "in a step runs X times slower until that step ends (benchmarks/simulator_fidelity.py "
        "measures it)",
    )
    g.add_argument(
        "--decode-interference",
        type=float,
        default=1.0,
        metavar="X",
        help="the other way: a prefill step that starts while a decode worker is in a step "
        "takes X times its cost alone",
    )
    g.add_argument("--step-gap-ms", type=float, default=0.0, help="host time between steps")
    g.add_argument("--dispatch-ms", type=float, default=0.0, help="client send -> routed")
    g.add_argument("--handover-ms", type=float, default=0.0, help="KV landed -> first token out")
    g.add_argument("--delivery-ms", type=float, default=0.0, help="a step's tokens -> the client")
    g.add_argument("--worker-start-s", type=float, default=60.0, help="a new worker's start-up")


def run(args: argparse.Namespace) -> int:
    from loadtest.report import format_record
    from loadtest.results import check_result_target, result_path, save_record
    from simulation.cluster import Simulation
    from simulation.report import simulated_record
    from simulation.workload import SimulationError

    for flag in ("sweep", "plot", "label"):  # bench's, with no meaning here yet
        if getattr(args, flag, None) is not None:
            raise CliError(f"--{flag} is tandem bench's; tandem simulate does not take it")
    bench = config_from_args(args)
    if bench.output.save_result is not None:  # refused now, not after the run
        check_result_target(bench.output.save_result)
    scenario = scenario_from_args(args)
    requests = requests_from_args(args, bench)
    try:
        simulation = Simulation(scenario, requests, bench.load)
    except SimulationError as err:
        raise CliError(str(err)) from None
    outcome = simulation.run()
    name = "trace" if args.trace else bench.dataset.spec.name
    record = simulated_record(
        outcome,
        scenario,
        bench.load,
        bench.output.percentiles,
        bench.output.goodput,
        name,
        per_request=not args.summary_only,
        metadata=dict(bench.output.metadata),
    )
    print(format_record(record, bench.output.percentile_metrics))
    sim = record["simulation"]
    print(f"simulated {outcome.duration_s:.1f} s of {sim['deployment']} in {sim['events']} events")
    if bench.output.save_result is not None:
        path = result_path(bench.output.save_result, record)
        save_record(record, path)
        print(f"Results saved to {path}")
    failed = [run for run in outcome.runs if run.finished_at is not None and run.error]
    if failed:  # (said only in the saved JSON before)
        done = len([run for run in outcome.runs if run.finished_at is not None])
        message = f"{len(failed)} of {done} simulated requests failed (first: {failed[0].error})"
        if len(failed) == done:
            raise CliError(message)
        print(f"tandem simulate: {message}", file=sys.stderr)
    return 0


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    from planning.cost_model import StepCostModel
    from planning.model_file import CostModelError
    from planning.transfer_model import TransferCostModel
    from simulation.deployment import (
        Costs,
        Deployment,
        EngineLimits,
        Overheads,
        Scenario,
    )
    from simulation.workload import SimulationError

    profile = args.profile or (args.model_dir / PROFILE_FILE if args.model_dir else None)
    if profile is None:
        raise CliError("give --profile (from tandem profile), or --model-dir with a saved profile")
    try:
        step = StepCostModel.load(profile)
        transfer = TransferCostModel.load(args.transfer_profile) if args.transfer_profile else None
        by_threads = dict(_thread_profile(text) for text in args.thread_profile)
    except (CostModelError, OSError) as err:
        raise CliError(str(err)) from None
    kv, num_blocks = _kv_size(args)
    colocated = args.mode == "colocated"
    budget = args.max_num_batched_tokens
    if budget is None:  # tandem serve's on the device the profile was measured on
        budget = default_batched_tokens(step.info.device or "cuda")
    try:
        deployment = Deployment(
            0 if colocated else args.prefill_workers,
            args.decode_workers,
            EngineLimits(
                num_blocks,
                args.block_size,
                args.max_num_seqs,
                budget,
                not args.no_prefix_caching,
                args.decode_headroom_tokens,
            ),
            args.routing,
            args.local_prefill_threshold,
            RouteCosts.from_step_model(step),
            late_after_s=None if args.late_after_ms is None else args.late_after_ms / 1e3,
            host_cores=args.host_cores,
            paced_cores=args.paced_cores,
            prefill_interference=args.prefill_interference,
            decode_interference=args.decode_interference,
        )
    except SimulationError as err:
        raise CliError(str(err)) from None
    ms = 1e-3
    try:
        overheads = Overheads(
            step_gap=args.step_gap_ms * ms,
            dispatch=args.dispatch_ms * ms,
            handover=args.handover_ms * ms,
            delivery=args.delivery_ms * ms,
            worker_start=args.worker_start_s,
        )
    except SimulationError as err:
        raise CliError(f"{err} (the --*-ms and --worker-start-s flags)") from None
    faults = tuple(_fault(text) for text in getattr(args, "kill", []))
    return Scenario(deployment, Costs(step, transfer, kv, by_threads), overheads, faults)


def _thread_profile(text: str) -> tuple[int, StepCostModel]:
    """--thread-profile T=PATH -> (T, the profile at PATH)."""
    from planning.cost_model import StepCostModel

    threads, sep, path = text.partition("=")
    if not sep or not threads.isdigit() or int(threads) < 1 or not path:
        raise CliError(f"--thread-profile takes THREADS=PATH (THREADS >= 1), not {text!r}")
    return int(threads), StepCostModel.load(Path(path))


def _fault(text: str):  # noqa: ANN202 (simulation.deployment.Fault, imported lazily)
    from simulation.deployment import Fault

    worker, _, seconds = text.partition("@")
    try:
        return Fault(float(seconds), worker)
    except ValueError:  # (SimulationError too: a time that is not finite and >= 0)
        raise CliError(f"--kill takes WORKER@SECONDS (e.g. decode-0@30), not {text!r}") from None


def _kv_size(args: argparse.Namespace) -> tuple[KVLayout | None, int]:
    """(KV layout, blocks per worker) from --model-dir's config, or --num-kv-blocks alone."""
    from engine.config import ConfigError, ModelConfig
    from protocol.kv import KVLayout

    if args.model_dir is None:
        if args.num_kv_blocks is None:
            raise CliError("give --model-dir (for its KV size) or --num-kv-blocks")
        return None, args.num_kv_blocks
    try:
        cfg = ModelConfig.from_pretrained(args.model_dir)
    except ConfigError as err:
        raise CliError(str(err)) from None
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "bfloat16")
    budget = default_of(EngineConfig, "kv_cache_memory_bytes")
    return layout, args.num_kv_blocks or budget // layout.bytes_for(args.block_size)


def requests_from_args(args: argparse.Namespace, bench: BenchConfig) -> list[SimRequest]:
    from simulation.workload import (
        SimulationError,
        from_samples,
        load_trace,
        synthetic_requests,
    )

    try:
        if getattr(args, "trace", None) is not None:
            return load_trace(args.trace)
        if bench.tokenizer is None:
            return synthetic_requests(bench.dataset, bench.load)
        from loadtest.datasets import sample_requests
        from loadtest.token_count import LocalTokenizer

        counter = LocalTokenizer(bench.tokenizer, bench.trust_remote_code)
        samples = sample_requests(bench.dataset, counter)
        return from_samples(samples, counter.encode, bench.load)
    except SimulationError as err:
        raise CliError(str(err)) from None
