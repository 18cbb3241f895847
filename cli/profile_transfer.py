"""The KV transfer sweep of `tandem profile --transport NAME`.

A prefill worker sends each request's KV one layer at a time, so what the simulator and the
planner need is the time to send one layer's KV of a prompt: a fixed cost per message plus one
per byte (planning/transfer_model.py). Here a receiver process posts a receive for one buffer,
this process sends it over the transport, timed on the sender as the prefill worker's layered
transfer is, for one layer of prompts from 16 to 4096 tokens of this model's KV layout. Each
size is timed several times and its fastest kept (the machine's noise only ever adds); some
sizes are held out of the fit and only scored.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import NamedTuple

from planning.transfer_model import TransferCostModel
from protocol.kv import KVLayout

TIMEOUT_S = 60.0  # one message, one wait: generous, but never forever
FIT_TOKENS = (16, 64, 256, 1024, 4096)  # prompt lengths whose one layer is sent
HELDOUT_TOKENS = (128, 2048)
QUICK_FIT_TOKENS = (16, 256, 1024)
QUICK_HELDOUT_TOKENS = (128,)
REPEATS = 7  # per size; the fastest counts
QUICK_REPEATS = 3


class TransferSample(NamedTuple):
    tokens: int
    num_bytes: int
    seconds: float
    heldout: bool


def sweep(
    transport_name: str, layout: KVLayout, quick: bool, log: Callable[[str], None]
) -> list[TransferSample]:
    """Times one layer's KV of every prompt length over `transport_name`, through a receiver
    in another process."""
    fit_tokens = QUICK_FIT_TOKENS if quick else FIT_TOKENS
    heldout_tokens = QUICK_HELDOUT_TOKENS if quick else HELDOUT_TOKENS
    repeats = QUICK_REPEATS if quick else REPEATS
    per_token = layout.bytes_per_token_layer()
    largest = max((*fit_tokens, *heldout_tokens)) * per_token
    with Receiver(transport_name, largest) as receiver:
        samples = []
        for tokens in sorted((*fit_tokens, *heldout_tokens)):
            num_bytes = tokens * per_token
            seconds = min(receiver.time_send(num_bytes) for _ in range(repeats))
            held = tokens in heldout_tokens
            log(f"kv {tokens:5d} tokens/layer  {num_bytes / 1e6:8.3f} MB  {seconds * 1e6:9.1f} us")
            samples.append(TransferSample(tokens, num_bytes, seconds, held))
    return samples


def fit(samples: list[TransferSample], transport_name: str) -> TransferCostModel:
    train = [(s.num_bytes, s.seconds) for s in samples if not s.heldout]
    heldout = [(s.num_bytes, s.seconds) for s in samples if s.heldout]
    return TransferCostModel.fit(train, heldout, transport=transport_name)


class Receiver:
    """A process holding the receiving end of one channel: it posts a receive of the size asked
    for, says so, and says again once the bytes are in."""

    def __init__(self, transport_name: str, max_bytes: int) -> None:
        import torch

        from kvtransfer.transport import make_transport

        self.transport = make_transport(transport_name, torch.device("cpu"))
        context = multiprocessing.get_context("spawn")  # no fork of a process running torch
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_receiver_main, args=(transport_name, max_bytes, child), daemon=True
        )
        self.process.start()
        endpoint = self._answer()
        self.channel = self.transport.connect(endpoint, "profile", TIMEOUT_S)
        self.source = torch.ones(max_bytes, dtype=torch.uint8)

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def time_send(self, num_bytes: int) -> float:
        self.conn.send(num_bytes)
        if self._answer() != "posted":
            raise RuntimeError("the receiver did not post its receive")
        start = time.perf_counter()
        self.channel.send(self.source[:num_bytes], TIMEOUT_S)
        seconds = time.perf_counter() - start
        if self._answer() != "received":
            raise RuntimeError("the receiver did not get the bytes")
        return seconds

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()

    def _answer(self) -> object:
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"the KV receiver did not answer in {TIMEOUT_S:.0f} s")
        answer = self.conn.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer


def _receiver_main(transport_name: str, max_bytes: int, conn: Connection) -> None:
    import torch

    from kvtransfer.transport import Rendezvous, make_transport

    try:
        torch.set_num_threads(1)
        transport = make_transport(transport_name, torch.device("cpu"))
        rendezvous = Rendezvous("127.0.0.1")
        accepted: dict[str, object] = {}
        accepting = threading.Thread(
            target=lambda: accepted.setdefault(
                "channel", transport.accept(rendezvous.store, "profile", TIMEOUT_S)
            ),
            daemon=True,
        )
        accepting.start()
        conn.send(rendezvous.endpoint)
        accepting.join(TIMEOUT_S)
        channel = accepted["channel"]
        target = torch.empty(max_bytes, dtype=torch.uint8)
        while (num_bytes := conn.recv()) is not None:
            arriving = channel.recv_async(target[:num_bytes])
            conn.send("posted")
            arriving.wait(TIMEOUT_S)
            conn.send("received")
    except Exception as err:  # noqa: BLE001  (handed to the sender, which raises it)
        conn.send(RuntimeError(f"KV receiver: {err!r}"))
