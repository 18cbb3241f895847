"""A decode engine's reservations (KV arriving from a prefill worker) against its own requests."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import LLMEngine
from protocol.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_requests_prefilled_here_leave_the_reserved_seats_free(tiny_llama) -> None:
    engine = LLMEngine(
        EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=2)
    )
    assert engine.reserve("remote", [5, 6, 7, 8, 9], PARAMS) is not None
    assert engine.has_room(len(engine.reserved))  # one seat left
    engine.add_request("a", [5, 6, 7], PARAMS)
    engine.add_request("b", [9, 8, 7], PARAMS)
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["a"]
    engine.admit("remote", 3)  # its KV arrived: the seat promised to it is there
    assert len(engine.scheduler.running) == engine.config.max_num_seqs
    assert [s.request_id for s in engine.scheduler.waiting] == ["b"]


def test_a_request_waiting_here_is_not_passed_by_reservations(tiny_llama) -> None:
    """A request queued here (or preempted) waits for a seat; reservations, made between
    steps, took every seat a finish freed before the next step could admit it, for as long as
    they kept coming."""
    engine = LLMEngine(
        EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=1)
    )
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("running", [5, 6, 7], short)
    engine.step()
    engine.add_request("local", [9, 8, 7], short)  # waits: the one seat is taken
    assert not engine.has_room(len(engine.reserved))
    for round_ in range(10):  # what a decode worker does: reserve while there is room
        if engine.has_room(len(engine.reserved)):
            assert engine.reserve(f"r{round_}", [3, 3, 3, 3], short) is not None
            engine.admit(f"r{round_}", 4)
        engine.step()
        if "local" not in engine.sequences:
            break
    assert "local" not in engine.sequences  # it ran, ahead of the reservations after it
