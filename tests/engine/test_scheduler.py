"""Scheduler plans at block_size 4, without a model: budgets, chunks, preemption, prefix hits."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerConfig, StepPlan, fits_with_headroom
from engine.sequence import Sequence, SequenceStatus
from protocol.sampling import FinishReason, SamplingParams

BS = 4


def make(num_blocks: int = 16, max_seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget), BlockManager(num_blocks, BS))


def seq(request_id: str, num_prompt: int, first_token: int = 1) -> Sequence:
    tokens = list(range(first_token, first_token + num_prompt))
    return Sequence(request_id, tokens, num_prompt, SamplingParams())


def run_step(scheduler: Scheduler) -> StepPlan:
    """Schedules, then does what the engine does after the model ran: commit, append tokens."""
    plan = scheduler.schedule()
    scheduler.commit(plan)
    for chunk in plan.chunks:
        if chunk.samples:
            chunk.seq.token_ids.append(999)
    return plan


def summary(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks]


def test_prompt_is_chunked_under_the_token_budget() -> None:
    s = make(budget=8)
    s.add(seq("a", 20))
    first = run_step(s)
    assert summary(first) == [("a", 0, 8)] and not first.chunks[0].samples
    assert summary(run_step(s)) == [("a", 8, 8)]
    plan = run_step(s)
    assert summary(plan) == [("a", 16, 4)] and plan.chunks[0].samples
    assert summary(run_step(s)) == [("a", 20, 1)]  # now decoding


def test_decodes_are_not_starved_by_a_long_prefill() -> None:
    s = make(budget=8)
    s.add(seq("a", 3))
    run_step(s)  # a prefilled, decoding from now on
    s.add(seq("b", 30, first_token=100))
    run_step(s)  # b admitted with the rest of the budget
    plan = run_step(s)
    assert ("a", 4, 1) in summary(plan)
    assert plan.num_batched_tokens <= 8


def test_decodes_beyond_the_budget_go_oldest_first() -> None:
    s = make(budget=2)
    for name, first in (("a", 1), ("b", 20), ("c", 40)):  # KV received: decoding at once
        running = seq(name, 3, first)
        running.block_table = s.blocks.allocate(1)
        s.add_running(running)
        running.token_ids.append(999)
    assert summary(run_step(s)) == [("a", 3, 1), ("b", 3, 1)]


def test_max_num_seqs_limits_admission() -> None:
    s = make(max_seqs=2)
    for name in "abc":
        s.add(seq(name, 3))
    assert [c[0] for c in summary(run_step(s))] == ["a", "b"]
    assert [x.request_id for x in s.waiting] == ["c"]


def test_seats_promised_to_arriving_kv_are_not_given_to_waiting_requests() -> None:
    s = make(max_seqs=3)
    for name in "abc":
        s.add(seq(name, 3))
    plan = s.schedule(num_reserved=2)  # two requests' KV is on its way: one seat is left
    assert [c[0] for c in summary(plan)] == ["a"]
    assert [x.request_id for x in s.waiting] == ["b", "c"]


def test_pool_exhaustion_preempts_the_newest_and_recomputes_it() -> None:
    s = make(num_blocks=4)  # 16 tokens of KV
    s.add(seq("old", 7))
    s.add(seq("new", 7, first_token=50))
    run_step(s)  # prompts in, 2 blocks each: the pool is full
    run_step(s)  # token 8 of each still fits in its second block
    plan = run_step(s)  # token 9 needs a third block: there is none
    assert [p.request_id for p in plan.preempted] == ["new"]
    assert summary(plan) == [("old", 8, 1)]
    preempted = s.waiting[0]
    assert preempted.request_id == "new" and preempted.status is SequenceStatus.WAITING
    assert preempted.num_computed_tokens == 0 and preempted.block_table == []
    assert preempted.num_tokens == 9  # prompt + 2 generated tokens, all to be recomputed


def test_prefix_cache_hit_skips_the_cached_tokens() -> None:
    s = make()
    first = seq("a", 10)
    s.add(first)
    run_step(s)
    s.finish(first, FinishReason.STOP)
    s.add(seq("b", 10))  # same 10 prompt tokens: two full blocks are cached
    plan = run_step(s)
    assert summary(plan) == [("b", 8, 2)]
    assert s.blocks.prefix_hits == 8


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    s = make()
    first = seq("a", 8)
    s.add(first)
    run_step(s)
    s.finish(first, FinishReason.STOP)
    s.add(seq("b", 8))
    assert summary(run_step(s)) == [("b", 4, 4)]  # the last full block is recomputed


def test_finish_and_abort_free_every_block() -> None:
    s = make(num_blocks=8)
    a, b = seq("a", 9), seq("b", 5, first_token=40)
    s.add(a)
    s.add(b)
    run_step(s)
    s.finish(a, FinishReason.ABORT)
    s.finish(b, FinishReason.STOP)
    assert s.blocks.num_free_blocks == 8 and s.num_unfinished == 0


def test_transferred_kv_fits_only_with_growth_room_for_every_request_held() -> None:
    blocks = BlockManager(10, BS)
    running = Sequence("a", list(range(10)), 10, SamplingParams(max_tokens=100))
    running.block_table = blocks.allocate(3)  # 10 tokens in 3 blocks; 7 blocks free
    new = Sequence("b", list(range(50, 58)), 8, SamplingParams(max_tokens=100))
    # 8 tokens of growth: a needs 5 - 3 = 2 more blocks, b 4 (its 2 + 2): 6 of the 7 free
    assert fits_with_headroom(blocks, [running], new, [], 8)
    # 16: a needs 7 - 3 = 4, b 6: 10 > 7
    assert not fits_with_headroom(blocks, [running], new, [], 16)
    assert fits_with_headroom(blocks, [running], new, [], 0)  # the prompt alone: 2 blocks
    assert fits_with_headroom(BlockManager(2, BS), [], new, [], 16)  # alone: if it fits, it goes
    # near max_tokens a request grows only to it: b may add 4 tokens (3 blocks), a 1 (3 blocks)
    short_b = Sequence("b", list(range(50, 58)), 8, SamplingParams(max_tokens=4))
    done_a = Sequence("a", list(range(10)), 9, SamplingParams(max_tokens=1))
    done_a.block_table = running.block_table
    assert fits_with_headroom(blocks, [done_a], short_b, [], 16)


def test_cached_prefix_blocks_count_as_taken_only_when_evictable() -> None:
    blocks = BlockManager(5, BS)
    done = Sequence("z", [7, 7, 7], 2, SamplingParams(max_tokens=1))  # grows no more
    done.block_table = blocks.allocate(1)
    owner = seq("a", 8)
    owner.block_table = blocks.allocate(2)
    blocks.cache_full_blocks(owner.block_table, owner.token_ids, 0, 2)
    hits = blocks.match_prefix(owner.token_ids)
    twin = Sequence("b", list(owner.token_ids), 8, SamplingParams(max_tokens=4))
    # held by a: reusing them costs nothing; 4 tokens of growth for b take 1 of the 2 free
    assert fits_with_headroom(blocks, [done], twin, hits, 4)
    blocks.free_blocks(owner.block_table)  # now evictable: counted free, but b takes them
    assert blocks.num_free_blocks == 4
    assert fits_with_headroom(blocks, [done], twin, hits, 4)  # 2 taken + 1 new <= 4
    longer = Sequence("c", list(owner.token_ids), 8, SamplingParams(max_tokens=100))
    assert not fits_with_headroom(blocks, [done], longer, hits, 12)  # 2 taken + 3 new > 4


def test_once_the_oldest_waiter_is_late_the_newest_is_admitted_first() -> None:
    """With a TTFT objective, the waiting line is first come first served until its oldest has
    waited past the objective; then the newest goes first (it can still be on time). A
    preempted sequence keeps its place at the front whatever its age."""
    now = [0.0]
    s = Scheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, late_after_s=2.0),
        BlockManager(16, BS),
        clock=lambda: now[0],
    )
    for i, name in enumerate("abc"):
        waiter = seq(name, 4, first_token=10 * i + 1)
        waiter.arrival_time = float(i)  # a at 0 s, b at 1 s, c at 2 s
        s.add(waiter)
    now[0] = 2.0  # a has waited exactly the objective: not late yet
    assert [c.seq.request_id for c in run_step(s).chunks] == ["a"]
    s.finish(s.running[0], FinishReason.STOP)
    now[0] = 3.5  # b has waited 2.5 s: late, so c (1.5 s) goes first
    assert [c.seq.request_id for c in run_step(s).chunks] == ["c"]
    assert s.running[0].first_scheduled_time == 3.5
    s._preempt(s.running.pop())  # c back at the front, preempted
    now[0] = 10.0
    assert [c.seq.request_id for c in run_step(s).chunks] == ["c"]
    s.finish(s.running[0], FinishReason.STOP)
    assert [c.seq.request_id for c in run_step(s).chunks] == ["b"]


def test_without_an_objective_the_line_is_first_come_first_served() -> None:
    s = make(max_seqs=1)
    for i, name in enumerate("abc"):
        waiter = seq(name, 4, first_token=10 * i + 1)
        waiter.arrival_time = -100.0 + i  # long past any objective
        s.add(waiter)
    order = []
    for _ in range(3):
        order += [c.seq.request_id for c in run_step(s).chunks]
        s.finish(s.running[0], FinishReason.STOP)
    assert order == ["a", "b", "c"]


def test_prompts_arriving_together_compute_their_shared_blocks_once() -> None:
    """Three copies of a 20-token prompt (the choices of one request with n = 3) and one that
    shares only its first two blocks: the first is prefilled, the others pass their turn while
    it computes the blocks they share, then start from the cache; one that shares nothing is
    not held back."""
    s = make(num_blocks=32, budget=64)
    for name in ("a", "b", "c"):
        s.add(seq(name, 20))
    shared = seq("d", 20)
    shared.token_ids[8:] = range(500, 512)  # blocks 0-1 as a's, then its own
    s.add(shared)
    s.add(seq("e", 20, first_token=900))
    first = run_step(s)
    assert summary(first) == [("a", 0, 20), ("e", 0, 20)]
    assert [w.request_id for w in s.waiting] == ["b", "c", "d"]  # order kept
    second = run_step(s)
    # b and c find a's 5 blocks cached (the last is computed anyway), d its first 2.
    assert summary(second)[-3:] == [("b", 16, 4), ("c", 16, 4), ("d", 8, 12)]
    assert s.blocks.prefix_hits == 16 + 16 + 8


def test_a_block_is_waited_for_only_while_another_prefill_still_has_it_to_compute() -> None:
    """A prompt prefilled in chunks: a copy arriving behind it takes the blocks already cached
    and waits for the rest; a prompt of less than a block never waits."""
    s = make(num_blocks=32, budget=16)
    s.add(seq("a", 24))
    run_step(s)  # a: tokens 0-15, blocks 0-3 cached
    s.add(seq("b", 24))
    s.add(seq("tiny", 3))
    plan = run_step(s)  # a: 16-23; b waits (block 4 is a's to compute); tiny goes
    assert summary(plan) == [("a", 16, 8), ("tiny", 0, 3)]
    plan = run_step(s)
    assert ("b", 20, 4) in summary(plan)  # b: blocks 0-4 from the cache, its last computed


def test_a_step_looks_at_no_more_passed_over_prompts_than_a_batch_holds() -> None:
    """Forty copies of a prompt behind the one computing its blocks: a step passes over at most
    max_num_seqs of them (not the whole line, prefix-matched at every step); they keep their
    order and all start from the cache once it is there."""
    s = make(num_blocks=128, max_seqs=8, budget=24)
    for i in range(41):
        s.add(seq(f"r{i}", 40))
    matched = []
    match = s.blocks.match_prefix
    s.blocks.match_prefix = lambda *args: matched.append(1) or match(*args)
    run_step(s)  # r0: tokens 0-23
    matched.clear()
    plan = run_step(s)  # r0: 24-39; r1.. wait for its block 6, computed in this step
    assert summary(plan) == [("r0", 24, 16)]
    assert len(matched) == 8  # max_num_seqs, not 40
    assert [w.request_id for w in s.waiting] == [f"r{i}" for i in range(1, 41)]
