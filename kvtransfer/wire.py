"""Message framing on a channel: a fixed-size msgpack frame, then an optional KV payload.

    frame    = uint8[FRAME_BYTES]: 2-byte little-endian length, then a msgpack map
    payload  = [2, num_tokens, kv_heads, head_dim] in the KV dtype (only after a "layer" frame)

A map too long for one frame is sent as {"ext": n} followed by n bytes of msgpack.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack
import torch

from kvtransfer.transport import Channel, TransferError

FRAME_BYTES = 128
_ROOM = FRAME_BYTES - 2


class LayerFrame(NamedTuple):
    """Layer `layer` of tokens [start, start + num_tokens) of request `request_id` follows."""

    request_id: str
    layer: int
    start: int
    num_tokens: int


class DoneFrame(NamedTuple):
    """Every layer of the request has been sent; `token_id` is the token prefill sampled."""

    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


class AbortFrame(NamedTuple):
    """The prefill side gave up on the request; nothing more will come for it."""

    request_id: str
    reason: str


Frame = LayerFrame | DoneFrame | AbortFrame
_KINDS: dict[str, type] = {"layer": LayerFrame, "done": DoneFrame, "abort": AbortFrame}
_NAMES = {kind: name for name, kind in _KINDS.items()}


def send_frame(channel: Channel, frame: Frame, timeout: float) -> None:
    body = msgpack.packb([_NAMES[type(frame)], *frame])
    if len(body) <= _ROOM:
        channel.send(_frame_tensor(body), timeout)
        return
    channel.send(_frame_tensor(msgpack.packb({"ext": len(body)})), timeout)
    channel.send(torch.frombuffer(bytearray(body), dtype=torch.uint8), timeout)


def recv_frame(channel: Channel, timeout: float | None) -> Frame:
    raw = torch.empty(FRAME_BYTES, dtype=torch.uint8)
    channel.recv(raw, timeout)
    body = _frame_body(raw)
    decoded: Any = msgpack.unpackb(body)
    if isinstance(decoded, dict):  # the real frame follows in `ext` bytes
        extended = torch.empty(decoded["ext"], dtype=torch.uint8)
        channel.recv(extended, 5.0 if timeout is None else timeout)
        decoded = msgpack.unpackb(extended.numpy().tobytes())
    name, *fields = decoded
    if name not in _KINDS:
        raise TransferError(f"unknown frame kind {name!r}")
    return _KINDS[name](*fields)


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
