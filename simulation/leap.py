"""Leaping over decode steps: one event for a run of steps that all look alike.

A decode worker whose batch is all decodes, with nothing waiting, runs the same step again and
again: each running sequence computes one token and samples the next, and the only things that
change are the context lengths (known ahead) and, every `block_size` tokens, one more KV block
per sequence. Simulating those steps one by one through the scheduler is what made a 128-GPU
hour slower than real time (hundreds of sequences per worker, tens of steps a second). A leap
plans them at once and plays them lazily:

    step i of the leap:  starts[i] ........ ends[i]  (gap)  starts[i+1] ........ ends[i+1]
                         takes the blocks   commits: KV counted, full blocks cached,
                         grow[i] lists      one token per sequence, delivered at ends[i]

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

from engine.block_manager import num_blocks_for
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from planning.cost_model import StepShape


@dataclass(eq=False)
class Leap:
    seqs: list[Sequence]  # the batch, in running order
    base: list[int]  # each one's num_computed_tokens when the leap began
    starts: list[float]
    ends: list[float]
    seconds: list[float]
    grow: dict[int, list[int]]  # step -> the sequences (indices) that take a block, in order
    fill: dict[int, list[int]]  # step -> the sequences whose last block fills when it commits
    num_steps: int  # the leap ends after this many steps (a cut lowers it)
    started: int = 0  # steps whose blocks are taken
    done: int = 0  # steps committed
    version: int = 0  # bumped by a cut: the event for the old end is void
    blocks_left: int = field(init=False)  # blocks the steps not yet started will take

    def __post_init__(self) -> None:
        self.blocks_left = sum(len(self.grow.get(i, ())) for i in range(self.num_steps))

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
    step_seconds: Callable[[StepShape], float],
) -> Leap | None:
    """Up to `max_steps` steps of the scheduler's running batch, or None when the next step is
    not a plain decode step of every running sequence (or fewer than two steps would leap)."""
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
    grow: dict[int, list[int]] = {}
    fill: dict[int, list[int]] = {}
    for index, (seq, computed) in enumerate(zip(seqs, base, strict=True)):
        if len(seq.block_table) < num_blocks_for(computed, bs):
            return None  # not a steady decode (the scheduler would take several blocks)
        # Step i computes token `computed + i`: a new block when that token starts one.
        first_grow = len(seq.block_table) * bs - computed
        for step in range(first_grow, max_steps, bs):
            grow.setdefault(step, []).append(index)
        for step in range(bs - 1 - computed % bs, max_steps, bs):
            fill.setdefault(step, []).append(index)
    num_steps, taken, free = 0, 0, scheduler.blocks.num_free_blocks
    while num_steps < max_steps and taken + len(grow.get(num_steps, ())) <= free:
        taken += len(grow.get(num_steps, ()))
        num_steps += 1
    if num_steps < 2:
        return None
    starts, ends, seconds = [], [], []
    context, start = sum(base), now
    for _ in range(num_steps):
        context += len(seqs)
        cost = max(step_seconds(StepShape(0, 0, len(seqs), context)), 1e-6)
        starts.append(start)
        ends.append(start + cost)
        seconds.append(cost)
        start = start + cost + step_gap
    return Leap(seqs, base, starts, ends, seconds, grow, fill, num_steps)


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
            taking = leap.grow.get(step, ())
            leap.blocks_left -= len(taking)
            for i in taking:
                if i in alive:  # in running order: the order blocks are handed out in
                    scheduler.grow(leap.seqs[i], leap.base[i] + step + 1)
        if step < done:
            for i in leap.fill.get(step, ()):
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
