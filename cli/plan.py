"""`tandem plan`: the pool sizes that serve a workload within an SLO on a number of GPUs.

    tandem plan --profile P --gpus 8 --slo ttft_p99=2s,itl_p99=50ms [--jobs N] [workload flags]

The workload flags are `tandem bench`'s (or --trace FILE). Every split of the GPUs into
colocated workers or prefill and decode pools is simulated (simulation/search.py); the table
shows each layout's predicted goodput and percentiles, best first, and the pick. An SLO no
layout meets is reported as infeasible; the plan never answers it with more GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cli.errors import CliError
from cli.simulate import add_deployment_flags, requests_from_args, scenario_from_args
from loadtest.cli import DefaultsFormatter, config_from_args
from loadtest.cli_flags import add_bench_flags

MAX_GPUS = 65536


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "plan",
        help="find the pool sizes that meet an SLO on N GPUs (by simulation)",
        description="Simulate every split of --gpus into prefill and decode pools (and all "
        "colocated) on a workload; print each layout's predicted goodput and percentiles and "
        "the best that meets --slo.",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs (CPU: workers) to split")
    p.add_argument("--tp", type=int, default=1, help="GPUs per worker (tensor parallel)")
    p.add_argument("--slo", required=True, help="e.g. ttft_p99=2s,itl_p99=50ms")
    p.add_argument("--trace", type=Path, help="a JSON-lines trace instead of a dataset")
    p.add_argument("--plan-json", type=Path, help="also write the plan here")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="layouts simulated at once, each in its own process (0: one per CPU); each holds "
        "the whole workload and one simulation in memory",
    )
    add_deployment_flags(p)
    add_bench_flags(p, taken=("--profile",))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from planning.slo import SloError, parse_slo
    from simulation.search import Candidate, search
    from simulation.workload import SimulationError

    # bench's output flags: a plan saves its table with --plan-json, nothing else (they were
    # taken and silently ignored)
    for flag in ("sweep", "plot", "label", "result_dir", "result_filename", "result_path"):
        if getattr(args, flag, None) is not None:
            name = f"--{flag.replace('_', '-')}"
            raise CliError(f"{name} is tandem bench's; tandem plan writes --plan-json instead")
    if args.save_result:
        raise CliError("--save-result is tandem bench's; tandem plan writes --plan-json instead")
    if args.gpus < 1 or args.tp < 1:
        raise CliError("--gpus and --tp must be at least 1")
    if args.gpus > MAX_GPUS:
        raise CliError(f"--gpus takes at most {MAX_GPUS}")
    if args.jobs < 0:
        raise CliError("--jobs must be 0 (one per CPU) or more")
    if args.gpus < args.tp:
        raise CliError(f"{args.gpus} GPUs hold no worker of {args.tp} GPUs (--tp)")
    target = args.plan_json
    if target is not None and (target.is_dir() or not target.parent.is_dir()):  # before the search
        where = "is a folder" if target.is_dir() else "is in no existing folder"
        raise CliError(f"--plan-json {target} {where}")
    jobs = args.jobs or len(os.sched_getaffinity(0))
    bench = config_from_args(args)
    scenario = scenario_from_args(args)
    scenario = dataclasses.replace(
        scenario, deployment=dataclasses.replace(scenario.deployment, gpus_per_worker=args.tp)
    )
    try:
        objectives = parse_slo(args.slo)
        requests = requests_from_args(args, bench)

        def show(c: Candidate) -> None:
            print(_row(c, objectives), flush=True)

        print(_header(objectives))
        plan = search(scenario, requests, bench.load, args.gpus, objectives, show, jobs)
    except (SimulationError, SloError) as err:
        raise CliError(str(err)) from None
    print()
    layouts = args.gpus // args.tp  # all colocated, and 1..W-1 prefill workers
    if len(plan.candidates) < layouts:
        print(f"simulated {len(plan.candidates)} of the {layouts} layouts, narrowing on the best")
    if plan.best is None:
        closest = plan.candidates[0]
        print(f"infeasible: no split of {args.gpus} GPUs meets {args.slo}; closest: ")
        print(f"  {closest.deployment.describe()} ({_predicted(closest)})")
    else:
        best = plan.best
        print(f"plan: {best.deployment.describe()} on {best.deployment.num_gpus} GPUs: "
              f"goodput {best.goodput:.2f} req/s ({best.goodput_per_gpu:.3f} per GPU), "
              f"{_predicted(best)}")  # fmt: skip
    if args.plan_json is not None:
        args.plan_json.write_text(json.dumps(_as_json(plan), indent=2))
    return 0 if plan.best is not None else 3


def _header(objectives) -> str:  # noqa: ANN001
    keys = "".join(f"{o.key:>16}" for o in objectives)
    return f"{'layout':<14}{'goodput/s':>11}{'per GPU':>10}{'req/s':>9}{keys}  meets"


def _row(c, objectives) -> str:  # noqa: ANN001
    values = "".join(f"{c.percentiles[o.key]:>16.1f}" for o in objectives)
    return (
        f"{c.deployment.describe():<14}{c.goodput:>11.2f}{c.goodput_per_gpu:>10.3f}"
        f"{c.throughput:>9.2f}{values}  {'yes' if c.feasible else 'no'}"
    )


def _predicted(c) -> str:  # noqa: ANN001
    return ", ".join(f"{key} {value:.0f}" for key, value in c.percentiles.items())


def _as_json(plan) -> dict:  # noqa: ANN001
    def one(c) -> dict:  # noqa: ANN001
        d = c.deployment
        return {
            "layout": d.describe(),
            "prefill_workers": d.prefill_workers,
            "decode_workers": d.decode_workers,
            "gpus": d.num_gpus,
            "goodput": c.goodput,
            "goodput_per_gpu": c.goodput_per_gpu,
            "request_throughput": c.throughput,
            "predicted_ms": c.percentiles,
            "feasible": c.feasible,
            "failed": c.failed,
        }

    return {
        "best": None if plan.best is None else one(plan.best),
        "candidates": [one(c) for c in plan.candidates],
    }
