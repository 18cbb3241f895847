"""`tandem profile`: measure a model's engine steps here and save the fitted cost model as JSON.

The sweep (cli/profile_sweep.py) runs on one in-process engine; `--from-telemetry` fits a file of
live step records instead. Either way some shapes are held out of the fit and only scored, and
the table printed says how far off the model is on them. `--transport NAME` also times one
layer's KV sent over that transport to another process (cli/profile_transfer.py) and saves the
fitted transfer model, the one `tandem simulate --transfer-profile` reads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cli.defaults import DEVICES, add_tensor_parallel_flag, default_of
from cli.errors import CliError
from engine.config import EngineConfig
from kvtransfer.names import TRANSPORT_NAMES
from loadtest.cli import DefaultsFormatter
from planning.model_file import PROFILE_FILE, TRANSFER_PROFILE_FILE
from protocol.kv import DTYPE_BYTES, KVLayout

if TYPE_CHECKING:
    from cli.profile_sweep import Measurement
    from planning.cost_model import StepCostModel
    from planning.transfer_model import TransferCostModel

PLACEMENT_TIMEOUT_S = 600.0  # --address: a node the autoscaler starts takes minutes
SWEEP_TIMEOUT_S = 7200.0  # --address: a full sweep of a large model
NOISY_CORES = 0.25  # other processes' CPU during a sweep past which its times are suspect
TELEMETRY_HELDOUT_EVERY = 5  # live records repeat no shape on purpose: hold out every 5th


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "profile",
        help="fit a per-step cost model for a model on this machine",
        description="Time engine steps of many shapes and save a fitted per-step cost model.",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--model", type=Path, help="model folder (default: the fetched default model)")
    p.add_argument("--dtype", default=default_of(EngineConfig, "dtype"), choices=list(DTYPE_BYTES))
    p.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=default_of(EngineConfig, "max_num_seqs"),
        metavar="N",
        help="largest decode batch measured (the engine's max_num_seqs)",
    )
    p.add_argument("--output", type=Path, help=f"where to save (default: <model>/{PROFILE_FILE})")
    p.add_argument("--quick", action="store_true", help="a few shapes only (tests, smoke runs)")
    p.add_argument(
        "--from-telemetry",
        type=Path,
        metavar="FILE",
        help="fit a JSON list of step records instead of sweeping",
    )
    p.add_argument("--show-shapes", action="store_true", help="print every measured shape")
    p.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="where the steps run; auto: cuda if there is a GPU (with --address: in the cluster)",
    )
    add_tensor_parallel_flag(
        p, "split the model across N ranks, as each worker of the pool will be"
    )
    cluster = p.add_argument_group(
        "on a Ray cluster (`ray up`: the head that runs `tandem serve` has no GPU)"
    )
    cluster.add_argument(
        "--address",
        help="run the step sweep on a worker node of this Ray cluster ('auto' on the head) "
        "and save the profile here, where `tandem serve` reads it",
    )
    cluster.add_argument(
        "--pool",
        choices=["prefill", "decode"],
        help="with --address: a node of this pool (its Ray resource, as cluster.yaml gives it)",
    )
    cluster.add_argument(
        "--placement-timeout",
        type=float,
        metavar="SECONDS",
        help=f"with --address: how long a node may take to be found or started "
        f"(default: {PLACEMENT_TIMEOUT_S:g})",
    )
    cluster.add_argument(
        "--sweep-timeout",
        type=float,
        metavar="SECONDS",
        help=f"with --address: how long the sweep may take once placed "
        f"(default: {SWEEP_TIMEOUT_S:g})",
    )
    kv = p.add_argument_group("KV transfer")
    kv.add_argument(
        "--transport",
        choices=TRANSPORT_NAMES,
        help="also time one layer's KV sent over this transport and save its cost model",
    )
    kv.add_argument(
        "--transfer-output",
        type=Path,
        metavar="FILE",
        help=f"where to save it (default: <model>/{TRANSFER_PROFILE_FILE})",
    )
    kv.add_argument(
        "--transfer-only", action="store_true", help="with --transport: skip the step sweep"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from planning.model_file import CostModelError

    for flag in ("threads", "max_batch", "tensor_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be at least 1")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.threads is not None and args.address is None and args.threads > (cores or 1):
        # (100,000 asked for: "can't start new thread", then a segmentation fault)
        raise CliError(f"--threads {args.threads} is more than this machine's {cores} cores")
    for flag in ("output", "transfer_output"):
        where = getattr(args, flag, None)
        if where is not None and Path(where).is_dir():  # found out only after the sweep
            raise CliError(f"--{flag.replace('_', '-')} {where} is a folder: name the file")
    for flag in ("pool", "placement_timeout", "sweep_timeout"):
        if getattr(args, flag) is not None and args.address is None:
            name = flag.replace("_", "-")
            raise CliError(f"--{name} needs --address (a sweep on a cluster's node)")
    for flag, default in (
        ("placement_timeout", PLACEMENT_TIMEOUT_S),
        ("sweep_timeout", SWEEP_TIMEOUT_S),
    ):
        value = getattr(args, flag)
        if value is not None and not 0 < value < float("inf"):
            raise CliError(f"--{flag.replace('_', '-')} must be a positive number of seconds")
        setattr(args, flag, default if value is None else value)
    if args.address is not None and args.from_telemetry is not None:
        raise CliError("--address runs a sweep; --from-telemetry fits records instead")
    if args.address is not None and args.transport is not None:
        raise CliError(
            "--transport times KV between two processes of this machine; with --address only "
            "the step sweep runs on the cluster (time the transfer on a worker node)"
        )
    if args.transfer_only and args.transport is None:
        raise CliError("--transfer-only needs --transport NAME")
    if args.transfer_only and args.from_telemetry is not None:
        raise CliError("--transfer-only and --from-telemetry exclude each other")
    try:
        if not args.transfer_only:
            if args.from_telemetry is not None:
                model, output = _fit_telemetry(args)
            else:
                model, output = _sweep_and_fit(args)
            model.save(output)
            _print_model(model, output)
        if args.transport is not None:
            transfer, transfer_output = _transfer_sweep_and_fit(args)
            transfer.save(transfer_output)
            _print_transfer(transfer, transfer_output)
    except CostModelError as err:
        raise CliError(str(err)) from None
    except OSError as err:
        raise CliError(f"cannot write {err.filename}: {err.strerror}") from None
    return 0


def _transfer_sweep_and_fit(args: argparse.Namespace) -> tuple[TransferCostModel, Path]:
    from cli import profile_transfer
    from engine.config import ModelConfig

    folder = _model_folder(args.model)
    output = args.transfer_output or folder / TRANSFER_PROFILE_FILE
    if not output.parent.is_dir():
        raise CliError(f"folder {output.parent} does not exist")
    cfg = ModelConfig.from_pretrained(folder)
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.dtype)
    try:
        samples = profile_transfer.sweep(args.transport, layout, args.quick, log=_log)
    except ImportError as err:  # ucx without the ucxx package
        raise CliError(f"KV transport {args.transport} is not available here: {err}") from None
    return profile_transfer.fit(samples, args.transport), output


def _print_transfer(model: TransferCostModel, output: Path) -> None:
    stats = model.stats
    bandwidth = 1 / model.seconds_per_byte / 1e9 if model.seconds_per_byte > 0 else float("inf")
    print(f"KV transfer over {model.transport}: {model.base_seconds * 1e6:.1f} us per layer "
          f"message + {bandwidth:.2f} GB/s")  # fmt: skip
    print(f"train MAE     {stats.train_mae_pct:6.2f}% over {stats.num_train} sizes")
    if stats.heldout_mae_pct is not None:
        print(f"held-out MAE  {stats.heldout_mae_pct:6.2f}% over {stats.num_heldout} sizes")
    print(f"wrote {output}")


def _fit_telemetry(args: argparse.Namespace) -> tuple[StepCostModel, Path]:
    from planning.cost_model import ProfileInfo, fit
    from planning.records import load_records, split_every

    if args.output is None and args.model is None:
        raise CliError("--from-telemetry needs --output (or --model, to save next to it)")
    records = load_records(args.from_telemetry)
    train, heldout = split_every(records, TELEMETRY_HELDOUT_EVERY)
    model_name = args.model.name if args.model is not None else ""
    info = ProfileInfo(model=model_name, dtype=args.dtype, source="telemetry")
    output = args.output or args.model / PROFILE_FILE
    return fit(train, heldout, info), output


def _sweep_and_fit(args: argparse.Namespace) -> tuple[StepCostModel, Path]:
    from cli.profile_sweep import SweepSettings, measure_steps
    from engine.config import ModelConfig, check_splits
    from planning.cost_model import fit

    folder = _model_folder(args.model, args.address)
    output = args.output or folder / PROFILE_FILE
    if not output.parent.is_dir():
        raise CliError(f"folder {output.parent} does not exist")
    check_splits(ModelConfig.from_pretrained(folder), args.tensor_parallel_size)  # before a node
    settings = SweepSettings(
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        max_batch=args.max_batch,
        tensor_parallel=args.tensor_parallel_size,
        quick=args.quick,
    )
    if args.address is not None:
        from cli import profile_cluster

        placement = profile_cluster.Placement(
            args.address, args.pool, args.placement_timeout, args.sweep_timeout
        )
        measured, info = profile_cluster.sweep(placement, folder, settings, log=_log)
    else:
        device = _local_device(args.device)
        measured, info = measure_steps(folder, settings._replace(device=device), log=_log)
    train = [m.record for m in measured if not m.heldout]
    heldout = [m.record for m in measured if m.heldout]
    model = fit(train, heldout, info)
    if args.show_shapes:
        _print_shapes(model, measured)
    return model, output


def _local_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _model_folder(model: Path | None, address: str | None = None) -> Path:
    if model is None:
        from engine.fetch import fetch_default_model

        return fetch_default_model()
    if not model.is_dir():
        raise CliError(f"model folder {model} does not exist")
    return model.resolve() if address is not None else model  # a path a worker node can read


def _log(line: str) -> None:
    print(f"profile: {line}", file=sys.stderr, flush=True)


def _print_model(model: StepCostModel, output: Path) -> None:
    print(f"{'feature':<20}{'us per unit':>14}")
    for name, coefficient in zip(model.features, model.coefficients, strict=True):
        print(f"{name:<20}{coefficient * 1e6:>14.4f}")
    stats = model.stats
    print(f"knee at {model.knee_rows} rows, linears switch kernel above {model.small_batch_rows}")
    print(f"train MAE     {stats.train_mae_pct:6.2f}% over {stats.num_train} shapes")
    if stats.heldout_mae_pct is not None:
        print(f"held-out MAE  {stats.heldout_mae_pct:6.2f}% over {stats.num_heldout} shapes")
    others = model.info.others_cores
    if others is not None and others > NOISY_CORES:
        print(f"other processes used {others:.2f} cores in the quietest pass: the times are")
        print("inflated by them; profile again on an idle machine for a model of this one alone")
    print(f"wrote {output}")


def _print_shapes(model: StepCostModel, measured: list[Measurement]) -> None:
    for m in measured:
        predicted = model.predict(m.record)
        error = (predicted - m.record.seconds) / m.record.seconds * 100
        tag = "held out" if m.heldout else ""
        print(
            f"{m.label:<40}{m.record.seconds * 1e3:9.2f} ms{predicted * 1e3:9.2f} ms"
            f"{error:+8.1f}%  {tag}"
        )
