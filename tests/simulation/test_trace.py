"""Trace files for `tandem simulate --trace`: rows become requests sorted by arrival, a shared
prefix id shares tokens, and a bad row is one clear SimulationError naming its line."""

import json

import pytest

from loadtest.config import LoadConfig
from simulation.workload import SimulationError, load_trace, with_arrivals


def write(tmp_path, rows) -> object:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_rows_become_requests_by_arrival_with_shared_prefixes(tmp_path) -> None:
    rows = [
        {"arrival": 2.0, "prompt_len": 40, "output_len": 8, "prefix_id": "sys", "prefix_len": 32},
        {"arrival": 0.5, "prompt_len": 36, "output_len": 4, "prefix_id": "sys", "prefix_len": 32},
        {"arrival": 1.0, "prompt_len": 10, "output_len": 2},
    ]
    requests = load_trace(write(tmp_path, rows))
    assert [r.arrival for r in requests] == [0.5, 1.0, 2.0]
    assert [(len(r.prompt_ids), r.output_len) for r in requests] == [(36, 4), (10, 2), (40, 8)]
    first, last = requests[0].prompt_ids, requests[2].prompt_ids
    assert first[:32] == last[:32] and first[32] != last[32]
    assert requests[1].prompt_ids[0] not in set(first)


@pytest.mark.parametrize(
    "row",
    [
        {"arrival": 0, "prompt_len": 10},  # no output_len
        '{"arrival": 0, "prompt_len": Infinity, "output_len": 1}',  # (an OverflowError)
        {"arrival": 0, "prompt_len": 10, "output_len": 1, "prefix_id": [1], "prefix_len": 4},
        {"arrival": 1e300, "prompt_len": 10, "output_len": 1},  # (the poll ticked to it forever)
        {"arrival": -1, "prompt_len": 10, "output_len": 1},
        "not json",
        # Prefixes that do not add up (they were clamped without a word once).
        {"arrival": 0, "prompt_len": 10, "output_len": 1, "prefix_id": "a", "prefix_len": 12},
        {"arrival": 0, "prompt_len": 10, "output_len": 1, "prefix_id": "a"},  # no prefix_len
        {"arrival": 0, "prompt_len": 10, "output_len": 1, "prefix_len": 4},  # no prefix_id
        {"arrival": 0, "prompt_len": 10, "output_len": 1, "prefix_id": "p", "prefix_len": 6},
    ],
)
def test_a_bad_row_names_its_line(tmp_path, row) -> None:
    good = {"arrival": 0, "prompt_len": 10, "output_len": 1, "prefix_id": "p", "prefix_len": 4}
    with pytest.raises(SimulationError, match=r"trace.jsonl:2: "):
        load_trace(write(tmp_path, [good, row]))


def test_a_prefix_of_another_length_than_before_names_both_lines(tmp_path) -> None:
    rows = [
        {"arrival": 0, "prompt_len": 10, "output_len": 1, "prefix_id": "sys", "prefix_len": 4},
        {"arrival": 1, "prompt_len": 10, "output_len": 1, "prefix_id": "sys", "prefix_len": 6},
    ]
    with pytest.raises(SimulationError, match="prefix 'sys' is 6 tokens here but 4 on line 1"):
        load_trace(write(tmp_path, rows))


def test_an_unreadable_trace_is_one_error(tmp_path) -> None:
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SimulationError, match="cannot read trace"):
        load_trace(path)


def test_a_rate_so_low_the_arrivals_leave_the_month_is_refused() -> None:
    prompts = [([1, 2, 3], 2)] * 3
    assert len(with_arrivals(prompts, LoadConfig(request_rate=1.0))) == 3
    with pytest.raises(SimulationError, match="at most"):
        with_arrivals(prompts, LoadConfig(request_rate=1e-300))
