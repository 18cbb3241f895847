"""Step records as measurements: medians of repeats, held-out splits, telemetry files."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planning.model_file import CostModelError, load_json
from protocol.telemetry import StepRecord

# A telemetry file may leave out what the cost model does not read.
OPTIONAL_FIELDS = {"end": 0.0, "kv_blocks_used": 0, "queue_length": 0, "threads": 0}


def median_record(records: Sequence[StepRecord]) -> StepRecord:
    """One record standing for repeats of a shape: the median of every field. A shared machine
    adds one-sided noise (a step is only ever slowed down), which the median ignores and the
    mean does not."""
    if not records:
        raise CostModelError("no records to take the median of")
    columns = list(zip(*records, strict=True))
    values = [statistics.median(column) for column in columns]
    fields = StepRecord._fields
    return StepRecord(
        *(v if fields[i] in ("end", "seconds") else round(v) for i, v in enumerate(values))
    )


def split_every(
    records: Sequence[StepRecord], nth: int
) -> tuple[list[StepRecord], list[StepRecord]]:
    """(train, held out): every `nth` record is held out. For telemetry, where no shape repeats
    on purpose; a sweep holds out whole shapes instead."""
    if nth < 2:
        raise CostModelError("hold out every 2nd record or fewer")
    train = [r for i, r in enumerate(records) if i % nth != nth - 1]
    heldout = [r for i, r in enumerate(records) if i % nth == nth - 1]
    return train, heldout


def load_records(path: Path) -> list[StepRecord]:
    """A JSON list of StepRecord objects (field name -> value), or a saved reply of
    `GET /admin/telemetry` ({"workers": {id: {"steps": [...]}}}: every worker's steps)."""
    data = load_json(path)
    if isinstance(data, dict) and isinstance(data.get("workers"), dict):
        data = [
            step
            for worker in data["workers"].values()
            if isinstance(worker, dict)
            for step in worker.get("steps", [])
        ]
    if not isinstance(data, list):
        raise CostModelError(f"{path}: expected a JSON list of step records")
    return [_record(item, i, path) for i, item in enumerate(data)]


def _record(item: Any, index: int, path: Path) -> StepRecord:
    if not isinstance(item, dict):
        raise CostModelError(f"{path}: record {index} is not an object")
    fields = {**OPTIONAL_FIELDS, **item}
    missing = [name for name in StepRecord._fields if name not in fields]
    if missing:
        raise CostModelError(f"{path}: record {index} lacks {', '.join(missing)}")
    try:
        record = StepRecord(
            float(fields["end"]),
            float(fields["seconds"]),
            *(int(fields[name]) for name in StepRecord._fields[2:]),
        )
    except (TypeError, ValueError) as err:
        raise CostModelError(f"{path}: record {index}: {err}") from None
    if not (0 < record.seconds < math.inf):  # (NaN fails too)
        seconds = record.seconds
        raise CostModelError(f"{path}: record {index} has seconds {seconds}: not finite and > 0")
    return record
