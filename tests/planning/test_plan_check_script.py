"""benchmarks/plan_check.py without serving: the layouts it serves are the ones `tandem plan`
tries, and a pick is scored by its measured goodput against the measured best."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_check.py"
_spec = importlib.util.spec_from_file_location("plan_check", SCRIPT)
plan_check = importlib.util.module_from_spec(_spec)
sys.modules["plan_check"] = plan_check
_spec.loader.exec_module(plan_check)


def planned(pick: str | None) -> dict:
    candidates = [
        {"layout": name, "goodput": 1.0, "feasible": True, "predicted_ms": {}}
        for name in ("3 colocated", "1P2D", "2P1D")
    ]
    best = None if pick is None else next(c for c in candidates if c["layout"] == pick)
    return {"best": best, "candidates": candidates}


def measured(**goodput: float) -> dict[str, dict]:
    names = {"colocated": "3 colocated", "p1d2": "1P2D", "p2d1": "2P1D"}
    return {
        names[key]: {"request_goodput": value, "p99_ttft_ms": 1.0, "p99_itl_ms": 1.0,
                     "request_throughput": value}
        for key, value in goodput.items()
    }  # fmt: skip


def test_it_serves_every_layout_the_plan_tries() -> None:
    names = [plan_check.layout_name(p, d) for p, d in plan_check.layouts(3)]
    assert names == ["3 colocated", "1P2D", "2P1D"]


def test_a_pick_within_five_percent_of_the_measured_best_meets_the_target() -> None:
    result = plan_check.compare(
        "chat", planned("2P1D"), measured(colocated=2.0, p1d2=1.0, p2d1=1.92)
    )
    assert result["measured_best"] == "3 colocated"
    assert abs(result["pick_share_of_best"] - 0.96) < 1e-9 and result["met"]
    result = plan_check.compare(
        "chat", planned("1P2D"), measured(colocated=2.0, p1d2=1.0, p2d1=1.9)
    )
    assert result["pick_share_of_best"] == 0.5 and not result["met"]


def test_no_pick_misses_the_target() -> None:
    result = plan_check.compare("chat", planned(None), measured(colocated=2.0, p1d2=1.0, p2d1=1.0))
    assert result["pick"] is None and not result["met"]
    assert "missed" in plan_check.format_table([result])
