"""Frames on the wire: every bit of a frame that says where KV goes, or which token a request
starts from, is checked; a flipped one breaks the channel instead of misplacing KV."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from kvtransfer.transport import TransferError
from kvtransfer.wire import AbortFrame, DoneFrame, PostedFrame, StepFrame, encode_frame


class _Received:
    def __init__(self, into: torch.Tensor, sent: torch.Tensor) -> None:
        into.copy_(sent)

    def wait(self, timeout: float | None) -> None:
        pass


class WireChannel:
    """Hands out the given tensors in order, as a channel's receives would."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.sent = deque(tensors)

    def recv_async(self, into: torch.Tensor) -> _Received:
        return _Received(into, self.sent.popleft())

    def recv(self, into: torch.Tensor, timeout: float) -> None:
        into.copy_(self.sent.popleft())


def read(tensors: list[torch.Tensor]):
    return PostedFrame(WireChannel(tensors)).read(1.0)  # type: ignore[arg-type]


STEP = StepFrame([["r0", 48, 96], ["r1", 40, 8]], 2)  # msgpack gives lists back
DONE = DoneFrame("r0", 17, -0.25, [[i, -float(i)] for i in range(40)])  # an extended frame


@pytest.mark.parametrize("frame", [STEP, AbortFrame("r0", "gone"), DONE])
def test_a_frame_reads_back_as_sent(frame) -> None:
    assert read(encode_frame(frame)) == frame


def test_every_flipped_bit_of_a_step_frame_breaks_the_channel() -> None:
    (raw,) = encode_frame(STEP)
    used = int(raw.nonzero().max()) + 1  # the zero padding follows
    for bit in range(used * 8):
        bad = raw.clone()
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(TransferError, match="corrupt frame"):
            read([bad])
    # The zero padding after the frame carries nothing: a flip there changes no field.
    bad = raw.clone()
    bad[-1] ^= 1
    assert read([bad]) == STEP


def test_a_flipped_bit_in_an_extended_frame_breaks_the_channel() -> None:
    header, body = encode_frame(DONE)
    for index in range(0, len(body), 7):
        bad = body.clone()
        bad[index] ^= 4
        with pytest.raises(TransferError, match="corrupt frame"):
            read([header, bad])


def test_a_step_frame_keeps_its_positions_or_fails() -> None:
    """The case the payload checksums cannot see: the bytes are right, the place is not. A
    start position changed on the wire (48 -> 49) must not decode as a valid frame."""
    (raw,) = encode_frame(STEP)
    data = bytearray(raw.numpy().tobytes())
    at = data.index(b"\xa2r0") + 3  # the id "r0", then 48 (msgpack: one byte)
    assert data[at] == 48
    data[at] = 49
    with pytest.raises(TransferError, match="CRC-32"):
        read([torch.frombuffer(data, dtype=torch.uint8)])
