"""Message framing on a channel: fixed-size msgpack frames, and KV payloads a frame announces.

    frame    = uint8[FRAME_BYTES]: 2-byte little-endian length, then a msgpack list
    payload  = [2, num_tokens, kv_heads, head_dim] in the KV dtype

One prefill step sends, per decode worker, one StepFrame naming its chunks, then one payload
per layer holding every chunk's tokens back to back, layer by layer as the layers finish:

    Step[(A, 0, 96), (B, 40, 8)]  L0[A B]  L1[A B] ...  L29[A B]   Done(A)  Done(B)

(each Done carrying the digest of its request's payloads when the ticket asks for checksums).
A channel the prefill side closes on purpose ends with a Close frame.

so the receiver can post every payload receive of the step at once, and nothing on the wire
waits for it. A frame too long for FRAME_BYTES is sent as {"ext": n} plus n bytes of msgpack.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack
import torch

from kvtransfer.transport import Channel, TransferError

FRAME_BYTES = 128
_ROOM = FRAME_BYTES - 2


class StepFrame(NamedTuple):
    """Payloads follow for tokens [start, start + num_tokens) of each chunk, every layer in
    order, chunks in this order within a layer."""

    chunks: list[tuple[str, int, int]]  # (request_id, start, num_tokens)
    num_layers: int


class DoneFrame(NamedTuple):
    """Every layer of the request has been sent; `token_id` is the token prefill sampled.
    `digest` folds every payload's checksum (kvtransfer/integrity.py); None when the ticket
    asked for none."""

    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    digest: int | None = None


class AbortFrame(NamedTuple):
    """The prefill side gave up on the request; nothing more will come for it."""

    request_id: str
    reason: str


class CloseFrame(NamedTuple):
    """The prefill side closes the channel on purpose (it stops serving, or its decode worker
    left the pool): nothing more comes on it."""

    reason: str


Frame = StepFrame | DoneFrame | AbortFrame | CloseFrame
_KINDS: dict[str, type] = {
    "step": StepFrame,
    "done": DoneFrame,
    "abort": AbortFrame,
    "close": CloseFrame,
}
_NAMES = {kind: name for name, kind in _KINDS.items()}


def encode_frame(frame: Frame) -> list[torch.Tensor]:
    """The tensors to send, in order, for one frame."""
    body = msgpack.packb([_NAMES[type(frame)], *frame])
    if len(body) <= _ROOM:
        return [_frame_tensor(body)]
    ext = _frame_tensor(msgpack.packb({"ext": len(body)}))
    return [ext, torch.frombuffer(bytearray(body), dtype=torch.uint8)]


def send_frame(channel: Channel, frame: Frame, timeout: float) -> None:
    for tensor in encode_frame(frame):
        channel.send(tensor, timeout)


class PostedFrame:
    """A frame receive posted ahead of time, so it overlaps work on the previous frame."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.raw = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        self.pending = channel.recv_async(self.raw)

    def read(self, timeout: float | None) -> Frame:
        self.pending.wait(timeout)
        decoded: Any = msgpack.unpackb(_frame_body(self.raw))
        if isinstance(decoded, dict):  # the real frame follows in `ext` bytes
            extended = torch.empty(decoded["ext"], dtype=torch.uint8)
            self.channel.recv(extended, 5.0 if timeout is None else timeout)
            decoded = msgpack.unpackb(extended.numpy().tobytes())
        name, *fields = decoded
        if name not in _KINDS:
            raise TransferError(f"unknown frame kind {name!r}")
        return _KINDS[name](*fields)


def recv_frame(channel: Channel, timeout: float | None) -> Frame:
    return PostedFrame(channel).read(timeout)


def _frame_tensor(body: bytes) -> torch.Tensor:
    raw = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    raw[:2] = torch.tensor(list(len(body).to_bytes(2, "little")), dtype=torch.uint8)
    raw[2 : 2 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return raw


def _frame_body(raw: torch.Tensor) -> bytes:
    data = raw.numpy().tobytes()
    length = int.from_bytes(data[:2], "little")
    if length > _ROOM:
        raise TransferError(f"corrupt frame (length {length})")
    return data[2 : 2 + length]
