"""Fault injection for tests: a transport whose channels misbehave on purpose.

    FaultyTransport(inner, Fault.CORRUPT, on_payload=3)

wraps any transport; on the prefill (sending) side, the chosen payload send (counting payloads
only, not frames, over all of the transport's channels; 0 is the first) is dropped, corrupted
(one bit flipped in a copy, after the sender computed its checksum), delayed, sent twice, or the
channel is cut just before it. `every=True` repeats the fault on every payload from then on.
`Fault.CORRUPT_FRAME` counts step frames with a chunk that starts past token 0 instead, and
flips the lowest set bit of the first such start: valid msgpack, payloads whose checksums
hold, and KV that would land earlier in the request's slots than it belongs.
Receiving is passed through: the decode side sees only what arrives.

The fault-injection suite (tests/kvtransfer/test_fault_injection.py) builds workers around it;
tests that need it in Ray workers pass a spec through DeployConfig.kv_fault (test only), which
`FaultyTransport.from_spec` reads: "delay,delay=0.2,every", "corrupt,on=3", ...
"""

from __future__ import annotations

import enum
import threading
import time

import msgpack
import torch

from kvtransfer.transport import Channel, Pending, TransferError, Transport
from kvtransfer.wire import FRAME_BYTES, HEADER_BYTES
from protocol.kv import Endpoint


class Fault(enum.Enum):
    DROP = "drop"  # lost on the wire: it takes its message number but never arrives
    CORRUPT = "corrupt"  # one bit flipped on the wire
    DELAY = "delay"  # sent `delay` seconds late (the channel's sender lane sleeps)
    DUPLICATE = "duplicate"  # arrives twice (the second copy under the same message number)
    CUT = "cut"  # the channel closes before the payload
    CORRUPT_FRAME = "corrupt_frame"  # one bit of a step frame's token position flipped


class FaultyTransport:
    def __init__(
        self,
        inner: Transport,
        fault: Fault,
        on_payload: int = 0,
        every: bool = False,
        delay: float = 0.0,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.fault = fault
        self.on_payload = on_payload
        self.every = every
        self.delay = delay
        self.injected = 0  # faults injected so far, over every channel
        self.payloads = 0  # payload sends seen so far, over every channel
        self._lock = threading.Lock()

    def strikes(self) -> bool:
        """Whether the payload being sent now gets the fault."""
        with self._lock:
            index = self.payloads
            self.payloads += 1
        return index == self.on_payload or (self.every and index > self.on_payload)

    @classmethod
    def from_spec(cls, inner: Transport, spec: str) -> FaultyTransport:
        """`spec`: a fault name, then `on=N`, `delay=S`, `every`, comma-separated."""
        name, *options = spec.split(",")
        fields: dict[str, object] = {}
        for option in options:
            key, _, value = option.partition("=")
            if key == "every":
                fields["every"] = True
            elif key == "on":
                fields["on_payload"] = int(value)
            elif key == "delay":
                fields["delay"] = float(value)
            else:
                raise ValueError(f"unknown fault option {option!r} in {spec!r}")
        return cls(inner, Fault(name), **fields)

    def connect(self, rendezvous: Endpoint, key: str, timeout: float) -> Channel:
        return _FaultyChannel(self.inner.connect(rendezvous, key, timeout), self)

    def accept(self, rendezvous, key: str, timeout: float) -> Channel:
        return self.inner.accept(rendezvous, key, timeout)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class _Done:
    finished = True

    def wait(self, timeout: float | None) -> None:
        return None


class _FaultyChannel:
    def __init__(self, channel: Channel, plan: FaultyTransport) -> None:
        self.channel = channel
        self.plan = plan

    def send_async(self, tensor: torch.Tensor) -> Pending:
        fault = self.plan.fault
        if fault is Fault.CORRUPT_FRAME:
            at = _start_at(tensor)
            if at is None or not self.plan.strikes():
                return self.channel.send_async(tensor)
            self.plan.injected += 1
            return self.channel.send_async(_flip_start_bit(tensor, at))
        if _is_frame(tensor) or not self.plan.strikes():
            return self.channel.send_async(tensor)
        self.plan.injected += 1
        if fault is Fault.DROP:
            self.channel.skip_message()
            return _Done()
        if fault is Fault.CORRUPT:
            return self.channel.send_async(_flip_one_bit(tensor))
        if fault is Fault.DELAY:
            time.sleep(self.plan.delay)
            return self.channel.send_async(tensor)
        if fault is Fault.DUPLICATE:
            first = self.channel.send_async(tensor)
            self.channel.send_again(tensor)  # never matched: nothing waits on it
            return first
        self.channel.close()  # Fault.CUT
        raise TransferError("injected: the channel was cut")

    def send(self, tensor: torch.Tensor, timeout: float) -> None:
        self.send_async(tensor).wait(timeout)

    def recv_async(self, tensor: torch.Tensor) -> Pending:
        return self.channel.recv_async(tensor)

    def recv(self, tensor: torch.Tensor, timeout: float | None) -> None:
        self.channel.recv_async(tensor).wait(timeout)

    def close(self) -> None:
        self.channel.close()


def _is_frame(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 1  # frames (and their msgpack extensions) are flat bytes


def _start_at(tensor: torch.Tensor) -> int | None:
    """Where the last byte of the first chunk's start past token 0 lies in a step frame
    (kvtransfer/wire.py's layout; msgpack ints are big-endian); None for any other tensor."""
    if tensor.dim() != 1 or tensor.numel() != FRAME_BYTES:
        return None
    data = tensor.numpy().tobytes()
    length = int.from_bytes(data[:2], "little")
    kind, *fields = msgpack.unpackb(data[HEADER_BYTES : HEADER_BYTES + length])
    if kind != "step":
        return None
    chunks = fields[0]
    at = HEADER_BYTES + 1 + len(msgpack.packb("step")) + len(_array_header(len(chunks)))
    for request_id, start, num_tokens in chunks:
        before = b"\x93" + msgpack.packb(request_id)
        if start:
            return at + len(before) + len(msgpack.packb(start)) - 1
        at += len(msgpack.packb([request_id, start, num_tokens]))
    return None


def _array_header(count: int) -> bytes:
    return msgpack.packb([None] * count)[:-count]  # each None is one byte


def _flip_start_bit(frame: torch.Tensor, at: int) -> torch.Tensor:
    """The frame with the start whose last byte is at `at` (`_start_at`) lowered by its lowest
    set bit, its CRC unchanged."""
    copy = frame.clone()
    copy[at] ^= int(copy[at]) & -int(copy[at])
    return copy


def _flip_one_bit(tensor: torch.Tensor) -> torch.Tensor:
    copy = tensor.clone()
    raw = copy.reshape(-1).view(torch.uint8)
    raw[raw.numel() // 2] ^= 0x10
    return copy
