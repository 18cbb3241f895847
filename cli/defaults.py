"""Flag defaults read from the config dataclasses, so a default is written down once."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

DEVICES = ["auto", "cpu", "cuda"]


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` of the dataclass `cls`; TypeError when it has none."""
    for field in dataclasses.fields(cls):
        if field.name != name:
            continue
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        raise TypeError(f"{cls.__name__}.{name} has no default")
    raise TypeError(f"{cls.__name__} has no field {name!r}")


def add_tensor_parallel_flag(parser: argparse._ActionsContainer, help: str) -> None:
    """`--tensor-parallel-size` / `-tp`, as every command that loads a model spells it."""
    from engine.config import EngineConfig

    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=default_of(EngineConfig, "tensor_parallel_size"),
        metavar="N",
        help=help,
    )


def add_gpu_memory_flag(parser: argparse._ActionsContainer, help: str) -> None:
    """`--gpu-memory-utilization`, as every command that loads a model on CUDA spells it."""
    from engine.config import EngineConfig

    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=default_of(EngineConfig, "gpu_memory_utilization"),
        metavar="SHARE",
        help=help,
    )
