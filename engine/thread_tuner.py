"""ThreadTuner: how many threads a CPU engine's ops should use, found by timing its own steps.

A CPU worker that serves shares its machine with the HTTP server, the coordinator and often the
load itself. Its ops run as OpenMP parallel regions, and a region waits for its slowest thread:
when another process preempts one thread of the team, the whole step waits. Whether a team of
every core or one of fewer steps faster depends on how much else runs, which the worker cannot
know at launch. On the 2-core development VM, served colocated at 64 streams of the 2-layer
overhead model ran ~8% faster on one thread than on two (the server and client take ~0.5 core
there); SmolLM2 at 16 streams, whose steps are 25 ms of linears, runs much faster on two
(docs/performance.md, "Engine threads tuned while serving").

So the engine thread times its steps: `hold_seconds` after the last probe it runs one, blocks
of `block_steps` steps on each candidate count in turn, `blocks` rounds (interleaved, so that a
change of load lands on every candidate), and keeps the count whose steps were fastest on
average, if it beats the count in use by more than `margin` (so that noise does not flip it).
The first step of each block is not counted (the team is re-formed then), nor the slowest
eighth of each candidate's steps (a prefill that happened to land in one block). Steps of one
probe are a second or two apart, so they have the same batch shapes in all but name. A probe
costs its steps on the slower counts (on SmolLM2, ~2% of 20 s): while probes keep the count,
the hold doubles, up to MAX_HOLD_FACTOR times; a switch brings it back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

HOLD_SECONDS = 20.0
MAX_HOLD_FACTOR = 4
BLOCK_STEPS = 8
BLOCKS = 4
MARGIN = 0.05
TRIM = 1 / 8  # the slowest share of a candidate's probe steps left out


def candidate_counts(most: int) -> list[int]:
    """Every core, one fewer (room for the serving process), and half."""
    return sorted({most, max(1, most - 1), max(1, most // 2)}, reverse=True)


class ThreadTuner:
    """Used by the engine thread alone: `count()` before each step, `observe()` after it."""

    def __init__(
        self,
        most: int,
        hold_seconds: float | None = None,  # default: HOLD_SECONDS
        block_steps: int = BLOCK_STEPS,
        blocks: int = BLOCKS,
        margin: float = MARGIN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.candidates = candidate_counts(most)
        self.current = most  # the count chosen (outside a probe, the one in use)
        self.hold_seconds = HOLD_SECONDS if hold_seconds is None else hold_seconds
        self._hold = self.hold_seconds  # the wait before the next probe
        if block_steps < 2:
            raise ValueError("a probe block needs at least 2 steps (its first is not counted)")
        self.block_steps = block_steps
        self.blocks = blocks
        self.margin = margin
        self._clock = clock
        self._probe_at = clock() + self.hold_seconds / 4  # the first probe: soon after start
        self._plan: list[tuple[int, bool]] = []  # (count, counted) for each coming probe step
        self._step: tuple[int, bool] | None = None  # what the step being timed runs
        self._times: dict[int, list[float]] = {}
        self.probes = 0
        self.switches = 0
        self.last_means: dict[int, float] = {}  # seconds per step of each count, last probe

    def count(self) -> int:
        """The thread count for the next step."""
        if len(self.candidates) > 1 and not self._plan and self._clock() >= self._probe_at:
            self._start_probe()
        if self._plan:
            self._step = self._plan.pop(0)
            return self._step[0]
        self._step = None
        return self.current

    def observe(self, seconds: float) -> None:
        """The step just taken took `seconds`."""
        if self._step is None:
            return
        count, counted = self._step
        if counted:
            self._times[count].append(seconds)
        if not self._plan:
            self._decide()

    def _start_probe(self) -> None:
        self._times = {count: [] for count in self.candidates}
        for _ in range(self.blocks):
            for count in self.candidates:
                self._plan += [(count, False)] + [(count, True)] * (self.block_steps - 1)

    def _decide(self) -> None:
        means = {count: _trimmed_mean(times) for count, times in self._times.items()}
        self.last_means = means
        self.probes += 1
        best = min(means, key=means.__getitem__)
        if best == self.current or means[best] >= means[self.current] * (1 - self.margin):
            self._hold = min(self._hold * 2, self.hold_seconds * MAX_HOLD_FACTOR)
        else:
            self._hold = self.hold_seconds
            log.info(
                "engine threads %d -> %d (mean step %s)",
                self.current,
                best,
                ", ".join(f"{c}: {m * 1e3:.2f} ms" for c, m in sorted(means.items())),
            )
            self.current = best
            self.switches += 1
        self._probe_at = self._clock() + self._hold


def _trimmed_mean(times: list[float]) -> float:
    kept = sorted(times)[: max(1, len(times) - int(len(times) * TRIM))]
    return sum(kept) / len(kept)
