"""Continuous-batching scheduler for one engine: decides which tokens each step computes.

Works on Sequences, counts and block ids only; it never sees a tensor. Each step:
  1. running sequences, oldest first: a decode computes 1 token, a partly prefilled sequence
     computes the next chunk of its prompt (leaving 1 token of budget per decode behind it);
     when the KV pool is full the newest running sequence is preempted (blocks freed, recomputed
     later from its prompt and output so far);
  2. waiting sequences, first come first served, start with whatever the prefix cache already
     holds and compute a first chunk, while the token budget and `max_num_seqs` allow. With a
     TTFT objective (`late_after_s`), once the oldest waiting request has waited past it the
     newest goes first instead (adaptive LIFO, as the coordinator's line for decode room:
     coordinator/room.py): under overload the oldest misses its objective whatever happens,
     and serving it first would make every request behind it miss too. A preempted sequence
     keeps its place at the front. A waiting sequence whose next uncached prompt block another
     sequence is prefilling right now is passed over until that block is cached (the n choices
     of one prompt, or requests sharing a system prompt, arriving together): it then starts
     from the cache instead of computing the same block again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from engine.block_manager import BlockManager, chain_hashes, num_blocks_for
from engine.sequence import Sequence, SequenceStatus
from planning.cost_model import StepShape
from protocol.sampling import FinishReason


def fits_with_headroom(
    blocks: BlockManager, held: Iterable[Sequence], seq: Sequence, hits: list[int], tokens: int
) -> bool:
    """Whether `seq` (its prompt, `hits` of it cached) can take blocks now and still leave each
    sequence `held` here, and itself, room to grow by `tokens` more tokens (fewer when its
    max_tokens is nearer). A decode worker admits transferred KV only so: once full, its only
    way on is preempting a running request, whose whole prompt it must then recompute itself.
    A worker holding nothing else takes any prompt that fits.
    """
    bs = blocks.block_size
    held = list(held)
    if not held:  # alone it can only grow into what is left: waiting would not give it more
        tokens = 0
    taken = sum(1 for block in hits if blocks.ref_counts[block] == 0)  # evictable, counted free
    need = _grown(seq, tokens, bs) - len(hits) + taken
    for other in held:
        need += max(0, _grown(other, tokens, bs) - len(other.block_table))
    return need <= blocks.num_free_blocks


def _grown(seq: Sequence, tokens: int, block_size: int) -> int:
    """Blocks the sequence will hold `tokens` tokens from now (none past max_tokens)."""
    room = max(0, min(tokens, seq.params.max_tokens - seq.num_output_tokens))
    return num_blocks_for(seq.num_tokens + room, block_size)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    late_after_s: float | None = None  # the TTFT objective, when one is set: see the docstring
    share_prefill: bool = True  # wait for a block another prefill is computing: the docstring


class ScheduledChunk(NamedTuple):
    seq: Sequence
    start: int  # first token position computed (the sequence's num_computed_tokens)
    num_tokens: int
    samples: bool  # the chunk reaches the last known token, so the step samples the next one

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        """The next `num_tokens` uncomputed tokens of `seq`."""
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    def shape(self) -> StepShape:
        """What the step computes, as the per-step cost model reads it: a multi-token chunk is
        prompt work (tokens, and tokens x context for attention), a one-token chunk a decode."""
        prefill_tokens = prefill_attention = decode_seqs = decode_context = 0
        for chunk in self.chunks:
            if chunk.num_tokens == 1:
                decode_seqs += 1
                decode_context += chunk.end
            else:
                prefill_tokens += chunk.num_tokens
                prefill_attention += chunk.num_tokens * chunk.end
        return StepShape(prefill_tokens, prefill_attention, decode_seqs, decode_context)


def _computing(prefilling: list[Sequence], block_hash: int, k: int, block_size: int) -> bool:
    """Whether one of the `prefilling` sequences has block k (chained hash `block_hash`) of its
    prompt still to compute: its next steps will cache it."""
    for other in prefilling:
        if other.num_hashed_blocks > k or (k + 1) * block_size > other.num_prompt_tokens:
            continue
        chain_hashes(other.token_ids, block_size, other.block_hashes, k + 1)
        if other.block_hashes[k] == block_hash:
            return True
    return False


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,  # the clock of Sequence.arrival_time
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admits a sequence whose every token already has KV in its blocks (received from a
        prefill worker); registers its full blocks in the prefix cache."""
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = seq.num_tokens
        self._cache_computed(seq)
        self.running.append(seq)

    def hold(self, seq: Sequence) -> None:
        """Takes a running sequence out of the batch with its blocks (its response format is
        still compiling); `resume` puts it back."""
        self.running.remove(seq)

    def resume(self, seq: Sequence) -> None:
        self.running.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, num_reserved: int = 0) -> StepPlan:
        """`num_reserved`: seats promised to sequences whose KV is arriving (`LLMEngine.reserve`,
        counted by `has_room`); waiting sequences are admitted only into the others."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        decodes_left = sum(1 for s in self.running if s.num_uncomputed_tokens == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            is_decode = seq.num_uncomputed_tokens == 1
            decodes_left -= is_decode
            # a prompt chunk leaves a token for each decode behind it; a decode takes its own
            n = 1 if is_decode else min(seq.num_uncomputed_tokens, budget - decodes_left)
            if n <= 0:
                i += 1
                continue
            while not self.grow(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                decodes_left -= victim is not seq and victim.num_uncomputed_tokens == 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chunks.append(ScheduledChunk.of(seq, n))
                budget -= n
                i += 1
        if not preempted:
            seats = self.config.max_num_seqs - num_reserved
            budget = self._admit_waiting(budget, chunks, seats)
        return StepPlan(tuple(chunks), tuple(preempted))

    def _admit_waiting(self, budget: int, chunks: list[ScheduledChunk], seats: int) -> int:
        bs = self.blocks.block_size
        passed_over: list[tuple[Sequence, bool]] = []  # (sequence, taken from the front)
        prefilling: list[Sequence] | None = None  # made when first needed
        # Passed-over requests take no budget and no seat, so a burst behind one prompt being
        # prefilled would otherwise be walked (and prefix-matched) in full at every step; a
        # step looks at no more of them than a batch holds, the rest wait their turn as before.
        while (
            self.waiting
            and budget > 0
            and len(self.running) < seats
            and len(passed_over) < self.config.max_num_seqs
        ):
            seq = self._next_waiting()
            front = seq is self.waiting[0]
            hits = (
                []
                if seq.scores_prompt
                else self.blocks.match_prefix(seq.token_ids, seq.block_hashes)
            )
            if self._shares_next_block(seq, len(hits)):
                if prefilling is None:
                    prefilling = [s for s in self.running if s.num_uncomputed_prompt_tokens]
                if _computing(prefilling, seq.block_hashes[len(hits)], len(hits), bs):
                    passed_over.append((seq, front))
                    self._take_waiting(front)
                    continue
            if len(hits) * bs >= seq.num_tokens:  # always compute at least the last token
                hits = hits[:-1]
            num_cached = len(hits) * bs
            n = min(seq.num_tokens - num_cached, budget)
            block_table = self.blocks.allocate_prefix(hits, num_cached + n)
            if block_table is None:
                break
            self.blocks.count_query(seq.num_tokens, num_cached)
            seq.block_table = block_table
            seq.num_computed_tokens = num_cached
            seq.num_hashed_blocks = len(hits)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = num_cached
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
            seq.status = SequenceStatus.RUNNING
            self._take_waiting(front)
            self.running.append(seq)
            if prefilling is not None and seq.num_uncomputed_prompt_tokens:
                prefilling.append(seq)
            chunks.append(ScheduledChunk.of(seq, n))
            budget -= n
        for seq, front in reversed(passed_over):  # back where each was, in the same order
            if front:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
        return budget

    def _take_waiting(self, front: bool) -> Sequence:
        return self.waiting.popleft() if front else self.waiting.pop()

    def _shares_next_block(self, seq: Sequence, k: int) -> bool:
        """Whether `seq`'s block k, the first one not cached, could come from another
        sequence's prefill: caching is on, the prompt is not scored, and block k is a full
        prompt block that is not the prompt's last (that one is computed anyway)."""
        return (
            self.config.share_prefill
            and self.blocks.enable_prefix_caching
            and not seq.scores_prompt
            and (k + 1) * self.blocks.block_size < seq.num_prompt_tokens
        )

    def _next_waiting(self) -> Sequence:
        """The oldest waiting sequence, or the newest once the oldest (not a preempted one) has
        waited past `late_after_s`."""
        oldest = self.waiting[0]
        late_after = self.config.late_after_s
        if (
            late_after is None
            or oldest.num_preemptions
            or self.clock() - oldest.arrival_time <= late_after
        ):
            return oldest
        return self.waiting[-1]

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes the block table cover `num_tokens`; False when the pool is too small."""
        missing = num_blocks_for(num_tokens, self.blocks.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        if missing > self.blocks.num_free_blocks:
            return False
        seq.block_table.extend(self.blocks.allocate(missing))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def commit(self, plan: StepPlan) -> None:
        """Records that the plan's KV is now written: advances counts, caches full blocks."""
        for chunk in plan.chunks:
            self.advance(chunk.seq, chunk.end)

    def advance(self, seq: Sequence, num_computed: int) -> None:
        """Tokens [0, num_computed) of `seq` now have KV: counts them, caches full blocks."""
        seq.num_computed_tokens = num_computed
        self._cache_computed(seq)

    def _cache_computed(self, seq: Sequence) -> None:
        num_full = seq.num_computed_tokens // self.blocks.block_size
        if num_full > seq.num_hashed_blocks:
            self.blocks.cache_full_blocks(
                seq.block_table, seq.token_ids, seq.num_hashed_blocks, num_full, seq.block_hashes
            )
            seq.num_hashed_blocks = num_full

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a sequence wherever it is (waiting or running) and frees its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
