"""A prefill worker refuses a request id it still holds: the id's step may be over while its
KV is still on the wire, and a second request under it would take over the first's books."""

from __future__ import annotations

import threading
import time

from engine.config import EngineConfig
from engine.engine import LLMEngine
from kvtransfer.transport import TransferError
from prefill.worker import PrefillReport, PrefillWorker
from protocol.errors import RequestError
from protocol.kv import Endpoint, Ticket
from protocol.messages import WorkRequest
from protocol.sampling import SamplingParams


class GatedTransport:
    """Every send completes only once `gate` is set: a transfer held on the wire."""

    name = "gated"

    def __init__(self) -> None:
        self.gate = threading.Event()

    def connect(self, rendezvous: Endpoint, key: str, timeout: float) -> GatedTransport:
        return self

    def send_async(self, tensor: object) -> GatedTransport:
        return self

    def send(self, tensor: object, timeout: float) -> None:
        self.wait(timeout)

    def wait(self, timeout: float | None) -> None:
        if not self.gate.wait(timeout):
            raise TransferError("the gate stayed shut")

    def close(self) -> None:
        pass


def test_an_id_still_in_transfer_is_refused_and_the_first_request_completes(tiny_llama) -> None:
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64))
    transport = GatedTransport()
    worker = PrefillWorker("p", engine, transport, transfer_timeout=20.0)
    prompt, params = list(range(3, 30)), SamplingParams(max_tokens=5, temperature=0)
    ticket = Ticket("X", "d", Endpoint("127.0.0.1", 1), "p->d:1#0", 0, len(prompt),
                    engine.kv_layout, 20.0)  # fmt: skip
    results: dict[str, list] = {"first": [], "second": []}
    try:
        worker.submit(WorkRequest("X", prompt, params), ticket,
                      lambda _, outcome: results["first"].append(outcome))  # fmt: skip
        deadline = time.monotonic() + 60
        while "X" in engine.sequences or "X" not in worker._pending:
            assert time.monotonic() < deadline, "the prefill step never ended"
            time.sleep(0.02)
        worker.submit(WorkRequest("X", prompt, params), ticket,
                      lambda _, outcome: results["second"].append(outcome))  # fmt: skip
        while not results["second"]:
            assert time.monotonic() < deadline, "the second request was never answered"
            time.sleep(0.02)
        transport.gate.set()
        while not results["first"]:
            assert time.monotonic() < deadline, "the first request was never answered"
            time.sleep(0.02)
    finally:
        transport.gate.set()
        worker.shutdown()
    [second] = results["second"]
    assert isinstance(second, RequestError) and "already in use" in str(second)
    assert [type(r) for r in results["first"]] == [PrefillReport]
