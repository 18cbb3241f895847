"""Routes between tensor-parallel layouts (protocol/kv.py): every decode rank gets each of its
heads exactly once, replicated heads leave one prefill rank, equal layouts pair rank i with i."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import ops
from protocol.kv import Route, kv_head_range, kv_routes

LAYOUTS = [(h, p, d) for h in (1, 2, 4, 8) for p, d in itertools.product((1, 2, 4, 8), repeat=2)]


@pytest.mark.parametrize(("heads", "prefill_tp", "decode_tp"), LAYOUTS)
def test_each_decode_rank_gets_each_of_its_heads_once_from_a_rank_that_holds_it(
    heads, prefill_tp, decode_tp
) -> None:
    routes = kv_routes(heads, prefill_tp, decode_tp)
    for dst in range(decode_tp):
        received = [h for r in routes if r.dst == dst for h in range(r.head_start, r.head_stop)]
        assert sorted(received) == list(kv_head_range(heads, decode_tp, dst))
    for route in routes:
        held = kv_head_range(heads, prefill_tp, route.src)
        assert held.start <= route.head_start < route.head_stop <= held.stop
    assert Route(0, 0, 0, routes[0].head_stop) == routes[0]  # 0>0 exists: it carries the token


@pytest.mark.parametrize(("heads", "size"), [(2, 4), (4, 8), (1, 2)])
def test_replicated_heads_are_sent_once_and_equal_layouts_pair_rank_i_with_i(heads, size):
    to_one = kv_routes(heads, size, 1)  # every head once, from its first holder
    assert [(r.src, r.head_start) for r in to_one] == [(h * size // heads, h) for h in range(heads)]
    assert all(r.src == r.dst for r in kv_routes(heads, size, size))


def test_named_layouts() -> None:
    assert kv_routes(4, 2, 1) == [Route(0, 0, 0, 2), Route(1, 0, 2, 4)]
    assert kv_routes(4, 1, 2) == [Route(0, 0, 0, 2), Route(0, 1, 2, 4)]
    assert kv_routes(4, 4, 2) == [
        Route(0, 0, 0, 1), Route(1, 0, 1, 2), Route(2, 1, 2, 3), Route(3, 1, 3, 4),
    ]  # fmt: skip
    assert kv_routes(2, 4, 2) == [Route(0, 0, 0, 1), Route(2, 1, 1, 2)]


def test_packing_some_heads_round_trips_into_the_same_heads_elsewhere() -> None:
    cache = [torch.randn(6, 4, 4, 8) for _ in range(2)]  # 6 blocks of 4 slots, 4 heads
    slots = torch.tensor([3, 9, 10, 22])
    payload = ops.pack_kv(*cache, slots, heads=range(1, 3))
    assert payload.shape == (2, 4, 2, 8)
    assert torch.equal(payload[0], cache[0].flatten(0, 1)[slots][:, 1:3])
    other = [torch.zeros(3, 8, 3, 8) for _ in range(2)]  # another block size, 3 heads
    ops.unpack_kv(payload, *other, torch.tensor([0, 1, 2, 17]), heads=range(1, 3))
    assert torch.equal(other[1].flatten(0, 1)[17][1:3], cache[1].flatten(0, 1)[22][1:3])
    assert not other[0].flatten(0, 1)[:, 0].any()  # the head the payload does not hold
    assert not other[0].flatten(0, 1)[3:17].any()  # nothing written outside the slots
