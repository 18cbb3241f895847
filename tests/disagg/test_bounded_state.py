"""A long-running worker keeps no per-request state: after a thousand requests through a
prefill and a decode worker, every container they (and their engines, senders and receivers)
hold is as large as after the first forty. (Transfer and step timings are histograms, not
lists of seconds.)"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from decode.worker import DecodeWorker
from engine.engine import LLMEngine
from prefill.worker import PrefillWorker
from protocol.messages import WorkRequest
from protocol.sampling import SamplingParams
from tests.kvtransfer.test_workers_per_transport import engine_config, run
from tests.support.transports import close_transport, transport_named

WAVE = 40  # requests at once: within the decode worker's batch and KV pool
WAVES = 25
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def sizes(root: object, depth: int = 3) -> Iterator[tuple[str, int]]:
    """(path, length) of every list, dict, set and deque reachable through attributes. A deque
    with a maxlen (the engine's telemetry logs) is bounded by construction: its bound counts."""
    seen: set[int] = set()

    def walk(obj: object, path: str, left: int) -> Iterator[tuple[str, int]]:
        if id(obj) in seen or left < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, deque) and obj.maxlen is not None:
            yield path, obj.maxlen
            return
        if isinstance(obj, list | dict | set | deque):
            yield path, len(obj)
            return
        for name, value in getattr(obj, "__dict__", {}).items():
            yield from walk(value, f"{path}.{name}", left - 1)

    yield from walk(root, "worker", depth)


def test_a_thousand_requests_grow_no_container(tiny_llama) -> None:
    transports = [transport_named("gloo"), transport_named("gloo")]
    config = engine_config(tiny_llama)
    prefill = PrefillWorker("p-long", LLMEngine(config), transports[0], 30.0)
    decode = DecodeWorker("d-long", LLMEngine(config), transports[1], 30.0)
    try:
        after: list[dict[str, int]] = []
        for wave in range(WAVES):
            requests = [
                WorkRequest(f"r{wave}-{i}", [5 + i % 7, 6, 7, 8], PARAMS) for i in range(WAVE)
            ]
            outcomes = run(prefill, decode, requests)
            assert len(outcomes.finished) == WAVE and not outcomes.errors
            after.append(dict(sizes(prefill)) | {f"d{k}": v for k, v in sizes(decode)})
        grown = {k: (after[0][k], v) for k, v in after[-1].items() if v > after[0].get(k, 0)}
        assert grown == {}, grown
        assert prefill.transfers.seconds.count == WAVES * WAVE
    finally:
        prefill.shutdown()
        decode.shutdown()
        for transport in transports:
            close_transport(transport)
