"""Message framing on a channel: fixed-size msgpack frames, and KV payloads a frame announces.

    frame    = uint8[FRAME_BYTES]: 2-byte little-endian length, then a msgpack list
    payload  = [2, num_tokens, kv_heads, head_dim] in the KV dtype

One prefill step sends, per decode worker, one StepFrame naming its chunks, then one payload
per layer holding every chunk's tokens back to back, layer by layer as the layers finish:

    Step[(A, 0, 96), (B, 40, 8)]  L0[A B]  L1[A B] ...  L29[A B]   Done(A)  Done(B)

(each Done carrying the digest of its request's payloads when the ticket asks for checksums).
A channel the prefill side closes on purpose ends with a Close frame.

Every frame carries a CRC-32 of its msgpack bytes, checked before it is decoded: the payloads'
checksums say the KV bytes are the ones sent, and this says where they go (a step frame's
token positions) and which token the request starts from (a done frame's) are the ones sent. A
frame that fails it breaks the channel (TransferError), so its requests fail and are retried
rather than land KV in the wrong slots. The layout, little-endian:

    frame = length (2 bytes) | crc32 of the msgpack (4 bytes) | msgpack | zero padding

so the receiver can post every payload receive of the step at once, and nothing on the wire
waits for it. A frame too long for FRAME_BYTES is sent as {"ext": n, "crc": crc32} plus n
bytes of msgpack.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import msgpack
import torch

from kvtransfer.transport import Channel, TransferError

FRAME_BYTES = 128
HEADER_BYTES = 6  # length and CRC-32
_ROOM = FRAME_BYTES - HEADER_BYTES


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
    ext = _frame_tensor(msgpack.packb({"ext": len(body), "crc": zlib.crc32(body)}))
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
            decoded = msgpack.unpackb(_checked(extended.numpy().tobytes(), decoded["crc"]))
        name, *fields = decoded
        if name not in _KINDS:
            raise TransferError(f"unknown frame kind {name!r}")
        return _KINDS[name](*fields)


def recv_frame(channel: Channel, timeout: float | None) -> Frame:
    return PostedFrame(channel).read(timeout)


def _frame_tensor(body: bytes) -> torch.Tensor:
    header = len(body).to_bytes(2, "little") + zlib.crc32(body).to_bytes(4, "little")
    raw = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    raw[: HEADER_BYTES + len(body)] = torch.frombuffer(bytearray(header + body), dtype=torch.uint8)
    return raw


def _frame_body(raw: torch.Tensor) -> bytes:
    data = raw.numpy().tobytes()
    length = int.from_bytes(data[:2], "little")
    if length > _ROOM:
        raise TransferError(f"corrupt frame (length {length})")
    crc = int.from_bytes(data[2:HEADER_BYTES], "little")
    return _checked(data[HEADER_BYTES : HEADER_BYTES + length], crc)


def _checked(body: bytes, crc: object) -> bytes:
    if crc != zlib.crc32(body):
        raise TransferError("corrupt frame (CRC-32 mismatch): its bytes are not the ones sent")
    return body
