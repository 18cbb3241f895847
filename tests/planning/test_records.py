"""Step records as measurements: medians of repeats and held-out splits."""

from __future__ import annotations

import json

import pytest

from planning.model_file import CostModelError
from planning.records import load_records, median_record, split_every
from protocol.telemetry import StepRecord


def test_median_record_ignores_one_slowed_repeat() -> None:
    repeats = [
        StepRecord(1.0, 0.010, 64, 4096, 2, 70, 9, 0),
        StepRecord(2.0, 0.500, 64, 4096, 2, 72, 9, 0),  # another process took the cores
        StepRecord(3.0, 0.011, 64, 4096, 2, 74, 9, 1),
    ]
    assert median_record(repeats) == StepRecord(2.0, 0.011, 64, 4096, 2, 72, 9, 0)


def test_median_of_nothing_is_an_error() -> None:
    with pytest.raises(CostModelError):
        median_record([])


def test_split_every_holds_out_every_nth() -> None:
    records = [StepRecord(float(i), 0.01, i, i, 0, 0, 0, 0) for i in range(10)]
    train, heldout = split_every(records, 5)
    assert [r.end for r in heldout] == [4.0, 9.0]
    assert len(train) == 8 and not set(train) & set(heldout)


def test_a_saved_admin_telemetry_reply_loads_every_workers_steps(tmp_path) -> None:
    step = StepRecord(1.0, 0.01, 0, 0, 4, 40, 3, 0)._asdict()
    reply = {
        "workers": {
            "decode-0": {"steps_total": 2, "steps": [step, step]},
            "prefill-0": {"steps_total": 1, "steps": [step]},
        }
    }
    path = tmp_path / "telemetry.json"
    path.write_text(json.dumps(reply))
    records = load_records(path)
    assert len(records) == 3 and records[0].decode_context == 40
