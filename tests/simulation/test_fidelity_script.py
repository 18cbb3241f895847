"""benchmarks/simulator_fidelity.py without serving: which decode steps count as started beside
a prefill step (the ones --fit-interference leaves out of the step model)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from protocol.telemetry import StepRecord

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "simulator_fidelity.py"
_spec = importlib.util.spec_from_file_location("simulator_fidelity", SCRIPT)
fidelity = importlib.util.module_from_spec(_spec)
sys.modules["simulator_fidelity"] = fidelity
_spec.loader.exec_module(fidelity)


def step(start: float, seconds: float, prefill_tokens: int = 0) -> StepRecord:
    return StepRecord(start + seconds, seconds, prefill_tokens, 0, 1, 100, 1, 0)


def test_decode_steps_that_start_inside_any_prefill_step_are_beside_it() -> None:
    inside_first = step(1.05, 0.02)
    inside_second = step(3.50, 0.02)
    before, between, at_an_end = step(0.50, 0.02), step(2.0, 0.9), step(1.20, 0.02)
    per_worker = {
        "prefill-0": [step(1.0, 0.2, 100)],  # 1.0 - 1.2 s
        "prefill-1": [step(3.0, 1.0, 800)],  # 3.0 - 4.0 s
        "decode-0": [before, inside_first, at_an_end, between, inside_second],
    }
    beside = fidelity.beside_prefill(per_worker)
    assert beside == {id(inside_first), id(inside_second)}
