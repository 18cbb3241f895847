"""Router: which workers a prompt goes to, and the loads it keeps (blocks of 4 tokens)."""

from __future__ import annotations

import pytest

from coordinator.router import (
    PREFILL_LOAD_BUCKET,
    REMEMBERED_PREFIXES,
    NoWorkerError,
    Route,
    RouteCosts,
    Router,
    prefix_hashes,
    queued_tokens,
)

BLOCK = 4
PROMPT_A = list(range(100, 112))  # three full blocks
PROMPT_B = list(range(200, 212))


def make_router(num_prefill: int = 2, num_decode: int = 2, local_threshold: int = 0) -> Router:
    prefill = [f"p{i}" for i in range(num_prefill)]
    decode = [f"d{i}" for i in range(num_decode)]
    return Router(prefill, decode, BLOCK, local_threshold)


def test_prefix_hashes_cover_full_blocks_and_chain() -> None:
    assert len(prefix_hashes(list(range(9)), BLOCK)) == 2
    assert prefix_hashes([1, 2, 3], BLOCK) == []
    same_tail_a = prefix_hashes([1, 1, 1, 1, 5, 6, 7, 8], BLOCK)
    same_tail_b = prefix_hashes([2, 2, 2, 2, 5, 6, 7, 8], BLOCK)
    assert same_tail_a[1] != same_tail_b[1]  # a block's hash depends on what came before
    assert prefix_hashes([1, 1, 1, 1, 9], BLOCK) == same_tail_a[:1]


def test_decode_prefers_fewest_running() -> None:
    router = make_router()
    first = router.route(PROMPT_A)
    router.placed(first, PROMPT_A)
    second = router.route(PROMPT_A)  # d0 holds the prefix, but d1 runs nothing
    assert (first.decode_id, second.decode_id) == ("d0", "d1")


def test_a_decode_worker_with_room_beats_a_full_one_even_if_avoided() -> None:
    """The request had failed on d1 (a role switch took it there and back), and d0 had just
    refused it: the route went to the full d0 while may_have_room() saw d1's room, so the
    coordinator asked d0 again and again, tens of thousands of times a second."""
    router = make_router()
    router.refused("d0")
    assert router.may_have_room()
    assert router.route(PROMPT_A, avoid=frozenset({"d1"})).decode_id == "d1"
    router.refused("d1")  # both full: the preference holds again
    assert router.route(PROMPT_A, avoid=frozenset({"d1"})).decode_id == "d0"


def test_decode_then_prefers_most_free_blocks() -> None:
    router = make_router()
    router.observe("d0", 10)
    router.observe("d1", 50)
    assert router.route(PROMPT_A).decode_id == "d1"
    router.placed(Route("d0", None), PROMPT_B)
    router.placed(Route("d1", None), PROMPT_B)
    router.placed(Route("d1", None), PROMPT_B)
    assert router.route(PROMPT_A).decode_id == "d0"  # running counts before free blocks


def test_decode_then_prefers_longest_prefix_overlap() -> None:
    router = make_router(num_decode=3)
    for decode_id, shared_blocks in (("d0", 1), ("d1", 2), ("d2", 0)):
        seen = PROMPT_A[: shared_blocks * BLOCK] + [0] * BLOCK
        route = Route(decode_id, None)
        router.placed(route, seen)
        router.finished(route)
    assert router.route(PROMPT_A).decode_id == "d1"
    assert router.route(PROMPT_B).decode_id == "d0"  # no overlap anywhere: the first


def test_prefill_prefers_lighter_queue_bucket_over_overlap() -> None:
    router = make_router(num_decode=1)
    router.placed(Route("d0", "p0"), PROMPT_A)  # p0 now holds PROMPT_A's prefix
    router.finished(Route("d0", "p0"))
    assert router.route(PROMPT_A).prefill_id == "p0"  # same bucket: overlap decides
    router.prefill["p0"].queued_tokens = PREFILL_LOAD_BUCKET
    assert router.route(PROMPT_A).prefill_id == "p1"  # a bucket more queued: overlap loses
    router.prefill["p0"].queued_tokens = PREFILL_LOAD_BUCKET - 1
    router.prefill["p1"].queued_tokens = 0
    assert router.route(PROMPT_A).prefill_id == "p0"  # near-equal loads count as equal


def test_short_uncached_prompt_prefills_on_the_decode_worker() -> None:
    router = make_router(num_decode=1, local_threshold=8)
    assert router.route(list(range(7))) == Route("d0", None)
    assert router.route(list(range(8))) == Route("d0", "p0")
    router.placed(Route("d0", "p0"), list(range(8)))
    assert router.route(list(range(9))) == Route("d0", "p0")  # its KV is not there yet
    router.cache_changed("d0", prefix_hashes(list(range(8)), router.block_size), [])
    # The decode worker reports both blocks: one new token to prefill, so it does it itself.
    assert router.route(list(range(9))) == Route("d0", None)


def test_threshold_zero_never_prefills_locally() -> None:
    router = make_router(num_decode=1, local_threshold=0)
    assert router.route([7]) == Route("d0", "p0")


def test_workers_that_left_are_skipped() -> None:
    router = make_router()
    router.placed(Route("d1", "p1"), PROMPT_B)  # d1 busier, but d0 is the one that dies
    router.remove("d0")
    router.remove("p0")
    assert router.route(PROMPT_A) == Route("d1", "p1")
    assert (router.is_alive("d0"), router.is_alive("p0"), router.is_alive("d1")) == (
        False, False, True
    )  # fmt: skip
    assert not router.is_alive("nobody")


def test_all_decode_workers_dead_raises() -> None:
    router = make_router()
    router.remove("d0")
    router.remove("d1")
    with pytest.raises(NoWorkerError, match="no live decode worker"):
        router.route(PROMPT_A)


def test_all_prefill_workers_dead_falls_back_to_local_prefill() -> None:
    router = make_router(local_threshold=0)
    router.remove("p0")
    router.remove("p1")
    assert router.route(PROMPT_A) == Route("d0", None)


def test_placed_prefilled_finished_bookkeeping() -> None:
    router = make_router()
    remote = Route("d0", "p1")
    router.placed(remote, PROMPT_A)
    router.placed(Route("d0", None), PROMPT_B)
    assert router.decode["d0"].running == 2
    assert router.prefill["p1"].queued_tokens == len(PROMPT_A)
    assert router.prefill["p0"].queued_tokens == 0  # a local prefill queues nothing remotely
    router.prefilled(remote, len(PROMPT_A))
    assert router.prefill["p1"].queued_tokens == 0
    router.prefilled(remote, len(PROMPT_A))
    assert router.prefill["p1"].queued_tokens == 0  # never negative
    router.finished(remote)
    router.finished(remote)
    router.finished(remote)
    assert router.decode["d0"].running == 0  # never negative


def test_observe_sets_free_blocks_of_the_named_worker_only() -> None:
    router = make_router()
    router.observe("d1", 7)
    router.observe("p0", 3)
    router.observe("unknown", 99)
    free = {w: load.free_blocks for w, load in {**router.prefill, **router.decode}.items()}
    assert free == {"p0": 3, "p1": 0, "d0": 0, "d1": 7}


def test_prefix_memory_is_bounded() -> None:
    router = Router(["p0"], ["d0"], 1, 0)
    prompt = list(range(REMEMBERED_PREFIXES + 100))
    router.placed(Route("d0", "p0"), prompt)  # the prefill worker computes it ...
    router.placed(Route("d0", None), prompt)  # ... and here the decode worker does
    hashes = prefix_hashes(prompt, 1)
    for load in (router.decode["d0"], router.prefill["p0"]):
        assert len(load.prefixes) == REMEMBERED_PREFIXES
        assert load.overlap(hashes[100:]) == REMEMBERED_PREFIXES  # the newest are kept
        assert load.overlap(hashes) == 0  # the oldest went first


def cost_router(num_prefill: int = 1, num_decode: int = 2) -> Router:
    prefill = [f"p{i}" for i in range(num_prefill)]
    decode = [f"d{i}" for i in range(num_decode)]
    return Router(prefill, decode, BLOCK, 0, policy="cost")


def test_cost_routing_uses_the_prefill_pool_when_nothing_is_cached() -> None:
    router = cost_router()
    assert router.route(PROMPT_A) == Route("d0", "p0")  # a tie goes to the prefill pool
    router.placed(Route("d0", "p0"), PROMPT_A)
    # While p0 still has A queued, the idle d1 prefilling B itself waits for nothing.
    assert router.route(PROMPT_B) == Route("d1", None)
    router.prefilled(Route("d0", "p0"), len(PROMPT_A))
    assert router.route(PROMPT_B) == Route("d1", "p0")  # d0 runs a request now


def test_cost_routing_prefills_on_the_decode_worker_holding_the_prompt() -> None:
    router = cost_router()
    router.decode["d0"].running = 1  # busier than d1, but it holds the prompt
    router.cache_changed("d1", [], [])
    router.cache_changed("d0", prefix_hashes(PROMPT_A, BLOCK), [])
    assert router.route(PROMPT_A + [7]) == Route("d0", None)  # one token left to prefill


def test_cost_routing_sends_short_prompts_to_decode_while_the_prefill_pool_is_busy() -> None:
    router = cost_router()
    router.prefill["p0"].queued_tokens = 10_000
    assert router.route(PROMPT_A) == Route("d0", None)
    router.prefill["p0"].queued_tokens = 0
    assert router.route(PROMPT_A) == Route("d0", "p0")


def test_cost_routing_picks_the_prefill_worker_that_holds_the_prefix() -> None:
    router = cost_router(num_prefill=2)
    router.cache_changed("p1", prefix_hashes(PROMPT_A, BLOCK), [])
    router.decode["d0"].running = router.decode["d1"].running = 2  # local prefill costs more
    assert router.route(PROMPT_A).prefill_id == "p1"
    router.cache_changed("p1", [], prefix_hashes(PROMPT_A, BLOCK)[1:])  # evicted: one left
    router.prefill["p1"].queued_tokens = 12
    assert router.route(PROMPT_A).prefill_id == "p0"


def test_a_cache_snapshot_replaces_what_the_router_knew() -> None:
    router = cost_router()
    router.cache_changed("d0", prefix_hashes(PROMPT_A, BLOCK), [])
    router.cache_changed("d0", prefix_hashes(PROMPT_B, BLOCK), [], snapshot=True)
    assert router.decode["d0"].overlap(prefix_hashes(PROMPT_A, BLOCK)) == 0
    assert router.decode["d0"].overlap(prefix_hashes(PROMPT_B, BLOCK)) == 3


def test_round_robin_takes_each_worker_in_turn() -> None:
    router = Router(["p0", "p1"], ["d0", "d1"], BLOCK, 0, policy="round-robin")
    routes = [router.route(PROMPT_A) for _ in range(4)]
    assert routes == [Route("d0", "p0"), Route("d1", "p1")] * 2


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="routing policy"):
        Router(["p0"], ["d0"], BLOCK, 0, policy="fastest")


@pytest.mark.parametrize("policy", ["cost", "load", "round-robin"])
def test_a_prefill_queue_counts_only_the_tokens_its_worker_must_compute(policy: str) -> None:
    router = Router(["p0"], ["d0"], BLOCK, 0, policy=policy)
    router.cache_changed("p0", prefix_hashes(PROMPT_A, BLOCK), [])
    prompt = PROMPT_A + [1, 2, 3, 4, 5]
    route = router.route(prompt)
    assert (route.prefill_id, route.prefill_tokens) == ("p0", 5)
    router.placed(route, prompt)
    assert router.prefill["p0"].queued_tokens == 5
    router.prefilled(route, queued_tokens(route, prompt))
    assert router.prefill["p0"].queued_tokens == 0


def test_route_prices_come_from_a_step_cost_model() -> None:
    from planning.cost_model import StepCostModel
    from planning.nnls import FitStats

    features = ("step", "small_batch_rows", "large_batch", "decode_context", "prefill_attention")
    coefficients = (0.01, 1e-4, 0.005, 1e-6, 1e-8)
    model = StepCostModel(features, coefficients, 16, 1024, FitStats(1, 0, 0, None))
    costs = RouteCosts.from_step_model(model, prompt_tokens=100, batch=16, context=200)
    # 100 fresh tokens: 16 small rows, the large-batch jump and 100 x 100 attention, per token.
    assert costs.prefill_token_seconds == pytest.approx((16e-4 + 0.005 + 1e4 * 1e-8) / 100)
    # 16 -> 32 decodes of 200 tokens: the jump plus 16 x 200 more context, per decode added.
    assert costs.decode_seq_seconds == pytest.approx((0.005 + 16 * 200 * 1e-6) / 16)


@pytest.mark.parametrize("policy", ["load", "cost", "round-robin"])
def test_a_decode_worker_that_refused_is_passed_over_until_it_may_have_room(policy: str) -> None:
    router = Router(["p0"], ["d0", "d1"], BLOCK, 0, policy)
    router.observe("d0", 50)
    router.observe("d1", 10)
    router.placed(Route("d1", "p0"), PROMPT_B)  # d0 runs fewer and has more free blocks
    assert router.route(PROMPT_A).decode_id == "d0"
    router.refused("d0")
    assert router.may_have_room()
    assert router.route(PROMPT_A).decode_id == "d1"
    router.refused("d1")
    assert not router.may_have_room()
    assert router.route(PROMPT_A).decode_id in ("d0", "d1")  # all full: still a route
    router.finished(Route("d1", "p0"))  # a request ended on d1: it may have room again
    assert router.may_have_room()
    assert router.route(PROMPT_A).decode_id == "d1"
    router.observe("d0", 50)  # so does a fresh report
    if policy == "load":
        assert router.route(PROMPT_A).decode_id == "d0"
