"""Leaping over decode steps: one event for a run of steps that all look alike.

A decode worker whose batch is all decodes, with nothing waiting, runs the same step again and
again: each running sequence computes one token and samples the next, and the only things that
change are the context lengths (known ahead) and, every `block_size` tokens, one more KV block
per sequence. Simulating those steps one by one through the scheduler is what made a 128-GPU
hour slower than real time (hundreds of sequences per worker, tens of steps a second). A leap
plans them at once and plays them lazily:

    step i of the leap:  starts[i] ........ ends[i]  (gap)  starts[i+1] ........ ends[i+1]
                         takes the blocks   commits: KV counted, full blocks cached,
                         growing(i) lists   one token per sequence, delivered at ends[i]

A sequence takes a block, and fills one, every `block_size` steps, so the sequences are kept
in `block_size` groups by the step (modulo block_size) on which they do: a leap of a thousand
steps over hundreds of sequences is planned in time proportional to the two, not their product.

`settle(t)` brings the worker to where step-by-step simulation would have it at time t (every
step started by t has its blocks, every step ended by t is committed and its tokens delivered),
performing the block manager's operations in the same order, so a leap changes no outcome, only
the number of events. Whoever reads or changes the worker settles it first; whoever changes its
batch also cuts the leap short after the step in progress.

A leap never includes a step in which a sequence finishes, and never grows past the free
blocks: those steps go through the real scheduler.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.block_manager import num_blocks_for
from engine.scheduler import Scheduler
from engine.sequence import Sequence


@dataclass(eq=False)
class Leap:
    seqs: list[Sequence]  # the batch, in running order
    base: list[int]  # each one's num_computed_tokens when the leap began
    starts: list[float]
    ends: list[float]
    seconds: list[float]
    # step % block_size -> the sequences (indices, in running order) that take a block on
    # such a step, from their first_grow on; and those whose last block fills when it commits
    grow_groups: list[list[int]]
    first_grow: list[int]
    fill_groups: list[list[int]]
    num_steps: int  # the leap ends after this many steps (a cut lowers it)
    started: int = 0  # steps whose blocks are taken
    done: int = 0  # steps committed
    version: int = 0  # bumped by a cut: the event for the old end is void
    blocks_left: int = 0  # blocks the steps not yet started will take
    all_grow_from: int = field(init=False)  # from this step on, every group member grows

    def __post_init__(self) -> None:
        self.all_grow_from = max(self.first_grow, default=0)

    def growing(self, step: int) -> list[int]:
        """The sequences (indices) that take a block when `step` starts, in running order."""
        group = self.grow_groups[step % len(self.grow_groups)]
        if step < self.all_grow_from:
            return [i for i in group if self.first_grow[i] <= step]
        return group

    def filling(self, step: int) -> list[int]:
        """The sequences whose last block fills when `step` commits."""
        return self.fill_groups[step % len(self.fill_groups)]

    @property
    def end(self) -> float:
        return self.ends[self.num_steps - 1]

    @property
    def in_step(self) -> bool:
        """A step has started and not ended."""
        return self.started > self.done


def plan_leap(
    scheduler: Scheduler,
    max_steps: int,
    now: float,
    step_gap: float,
    decode_seconds: Callable[[int, np.ndarray], np.ndarray],
) -> Leap | None:
    """Up to `max_steps` steps of the scheduler's running batch, or None when the next step is
    not a plain decode step of every running sequence (or fewer than two steps would leap).
    `decode_seconds(num_seqs, contexts)`: each decode step's seconds, by its total context
    (`StepCostModel.predict_decodes`)."""
    seqs = list(scheduler.running)
    if (
        scheduler.waiting
        or not seqs
        or len(seqs) > scheduler.config.max_num_batched_tokens
        or any(s.num_uncomputed_tokens != 1 for s in seqs)
    ):
        return None
    bs = scheduler.blocks.block_size
    base = [s.num_computed_tokens for s in seqs]
    grow_groups: list[list[int]] = [[] for _ in range(bs)]
    fill_groups: list[list[int]] = [[] for _ in range(bs)]
    first_grow: list[int] = []
    for index, (seq, computed) in enumerate(zip(seqs, base, strict=True)):
        if len(seq.block_table) < num_blocks_for(computed, bs):
            return None  # not a steady decode (the scheduler would take several blocks)
        # Step i computes token `computed + i`: a new block when that token starts one,
        # every bs steps from the first; the block it is in fills on step bs - 1 - computed % bs.
        first_grow.append(len(seq.block_table) * bs - computed)
        grow_groups[first_grow[-1] % bs].append(index)
        fill_groups[bs - 1 - computed % bs].append(index)
    num_steps, taken, free = 0, 0, scheduler.blocks.num_free_blocks
    leap = Leap(seqs, base, [], [], [], grow_groups, first_grow, fill_groups, 0)
    while num_steps < max_steps and taken + len(leap.growing(num_steps)) <= free:
        taken += len(leap.growing(num_steps))
        num_steps += 1
    if num_steps < 2:
        return None
    contexts = sum(base) + len(seqs) * np.arange(1, num_steps + 1, dtype=np.int64)
    seconds = np.maximum(decode_seconds(len(seqs), contexts), 1e-6).tolist()
    starts, ends, start = [], [], now
    for cost in seconds:
        starts.append(start)
        ends.append(start + cost)
        start = start + cost + step_gap
    leap.starts, leap.ends, leap.seconds, leap.num_steps = starts, ends, seconds, num_steps
    leap.blocks_left = taken
    return leap


def settle(
    leap: Leap,
    scheduler: Scheduler,
    now: float,
    deliver: Callable[[list[Sequence], list[float]], None],
) -> list[float]:
    """Plays the leap's steps up to `now`: blocks for the steps started, commits for the steps
    ended; `deliver(seqs, ends)` hands the live sequences one new token per step ended (at
    those end times). Returns the seconds of the steps committed."""
    started = bisect.bisect_right(leap.starts, now, hi=leap.num_steps)
    done = bisect.bisect_right(leap.ends, now, hi=leap.num_steps)
    if started <= leap.started and done <= leap.done:
        return []
    live = [i for i, seq in enumerate(leap.seqs) if not seq.is_finished]  # (none ends in here)
    if done > leap.done:  # the tokens first: caching a full block reads its token ids
        deliver([leap.seqs[i] for i in live], leap.ends[leap.done : done])
    alive = set(live)
    for step in range(leap.done, started):
        if step >= leap.started:
            taking = leap.growing(step)
            leap.blocks_left -= len(taking)
            # One block each, handed out in running order: what scheduler.grow would do for
            # each in turn, in one call to the block manager.
            takers = [leap.seqs[i] for i in taking if i in alive]
            for seq, block in zip(takers, scheduler.blocks.allocate(len(takers)), strict=True):
                seq.block_table.append(block)
        if step < done:
            for i in leap.filling(step):
                if i in alive:
                    scheduler.advance(leap.seqs[i], leap.base[i] + step + 1)
    for i in live:
        leap.seqs[i].num_computed_tokens = leap.base[i] + done
    committed = leap.seconds[leap.done : done]
    leap.started, leap.done = max(started, leap.started), max(done, leap.done)
    return committed


def cut(leap: Leap) -> None:
    """Ends the leap after the step in progress (or now, between steps)."""
    leap.num_steps = leap.started if leap.in_step else leap.done
    leap.blocks_left = 0  # every step left has its blocks
    leap.version += 1
