"""One prefill rank's share of a step's KV sends: its legs (protocol/kv.py routes), announced
before the forward pass and packed layer by layer as the layers finish.

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
    slots: torch.Tensor  # [n] int64 slot ids


def announce(
    sender: KVSender,
    chunks: list[StepChunk],
    rank: int,
    kv_head_start: int,
    num_layers: int,
    device: torch.device,
) -> list[LegChunk]:
    """Announces rank `rank`'s legs of the step's chunks, one StepFrame per channel, and
    returns them in the order their payloads must follow, each layer."""
    by_channel: dict[str, list[tuple[LegChunk, int]]] = {}
    for chunk in chunks:
        slots = torch.tensor(chunk.slots, dtype=torch.int64, device=device)
        for leg, route in chunk.ticket.legs(rank):
            heads = range(route.head_start - kv_head_start, route.head_stop - kv_head_start)
            by_channel.setdefault(leg.channel_key, []).append(
                (LegChunk(leg, heads, slots), chunk.start)
            )
    ordered: list[LegChunk] = []
    for entries in by_channel.values():
        announced = [(leg.ticket, start, leg.slots.numel()) for leg, start in entries]
        sender.send_step(announced, num_layers)
        ordered.extend(leg for leg, _ in entries)
    return ordered


def pack_layer(
    legs: list[LegChunk], key_cache: torch.Tensor, value_cache: torch.Tensor
) -> list[tuple[LegChunk, torch.Tensor]]:
    """Each leg's payload of one layer: [2, n, len(heads), head_dim], in its own buffer."""
    return [(leg, ops.pack_kv(key_cache, value_cache, leg.slots, heads=leg.heads)) for leg in legs]


def ready_event(payload: torch.Tensor) -> torch.cuda.Event | None:
    """On CUDA, an event recorded after the pack: the sender waits for it before sending."""
    if payload.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
