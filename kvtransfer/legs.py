"""One prefill rank's share of a step's KV sends: its legs (protocol/kv.py routes), announced
before the forward pass and packed layer by layer as the layers finish, one payload per
channel and layer (a wave of 16 prompts on a 24-layer model is 24 sends, not 384).

Prefill rank 0 and the follower ranks of a tensor-parallel prefill worker both send this way,
each only the routes whose `src` is its own rank, each from its own KV cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import ops
from kvtransfer.sender import KVSender
from protocol.kv import Ticket


class StepChunk(NamedTuple):
    """Tokens [start, start + len(slots)) of a request, sent this step from `slots`."""

    ticket: Ticket
    start: int
    slots: list[int]


class LegChunk(NamedTuple):
    """A chunk's heads on one leg: `ticket` names the leg's channel, `heads` are the sending
    rank's cache heads the leg carries."""

    ticket: Ticket
    heads: range
    slots: list[int]


class ChannelStep(NamedTuple):
    """This rank's legs of a step on one channel, in the order announced: each layer's payload
    for all of them travels as one, their tokens back to back."""

    legs: list[LegChunk]
    slots: torch.Tensor  # every leg's slots, concatenated
    heads: range  # of the sending rank's cache; a channel's legs all carry the same heads

    @property
    def parts(self) -> list[tuple[Ticket, int]]:
        """(ticket, tokens) per leg: how the payload divides."""
        return [(leg.ticket, len(leg.slots)) for leg in self.legs]


def announce(
    sender: KVSender,
    chunks: list[StepChunk],
    rank: int,
    kv_head_start: int,
    num_layers: int,
    device: torch.device,
) -> list[ChannelStep]:
    """Announces rank `rank`'s legs of the step's chunks, one StepFrame per channel, and
    returns them per channel, in the order their payloads follow each layer."""
    by_channel: dict[str, list[tuple[LegChunk, int]]] = {}
    for chunk in chunks:
        for leg, route in chunk.ticket.legs(rank):
            heads = range(route.head_start - kv_head_start, route.head_stop - kv_head_start)
            by_channel.setdefault(leg.channel_key, []).append(
                (LegChunk(leg, heads, chunk.slots), chunk.start)
            )
    steps: list[ChannelStep] = []
    for key, entries in by_channel.items():
        legs = [leg for leg, _ in entries]
        if len({leg.heads for leg in legs}) != 1:
            raise ValueError(f"legs on channel {key} carry different heads")
        announced = [(leg.ticket, start, len(leg.slots)) for leg, start in entries]
        sender.send_step(announced, num_layers)
        # one copy to the device per channel and step (on a GPU, each is a wait for it)
        slots = torch.tensor([s for leg in legs for s in leg.slots], device=device)
        steps.append(ChannelStep(legs, slots, legs[0].heads))
    return steps


def pack_layer(
    steps: list[ChannelStep], key_cache: torch.Tensor, value_cache: torch.Tensor
) -> list[tuple[ChannelStep, torch.Tensor]]:
    """Each channel's payload of one layer: [2, tokens, len(heads), head_dim], one gather into
    a buffer of its own, the legs' tokens in announce order."""
    return [(s, ops.pack_kv(key_cache, value_cache, s.slots, heads=s.heads)) for s in steps]


def ready_event(payload: torch.Tensor) -> torch.cuda.Event | None:
    """On CUDA, an event recorded after the pack: the sender waits for it before sending."""
    if payload.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
