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
of `block_steps` steps on each candidate count in turn, `blocks` rounds. Each round compares a
candidate's mean step with the mean step of the count in use in the same round (a second or so
apart: the same batch shapes in all but name, and a change of load lands on both), and the
probe keeps the candidate whose median ratio over the rounds is lowest, if it is under
1 - `margin` (so that noise does not flip it). The first step of each block is not counted (the
team is re-formed then), nor the slowest eighth of a block's steps (a prefill that happened to
land in it). A probe
costs its steps on the slower counts (on SmolLM2, ~2% of 20 s): while probes keep the count,
the hold doubles, up to MAX_HOLD_FACTOR times; a switch brings it back.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

HOLD_SECONDS = 20.0
MAX_HOLD_FACTOR = 4
BLOCK_STEPS = 8
BLOCKS = 6
MARGIN = 0.05
TRIM = 1 / 8  # the slowest share of a block's steps left out


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
        # (count, round, counted) for each coming probe step
        self._plan: list[tuple[int, int, bool]] = []
        self._step: tuple[int, int, bool] | None = None  # what the step being timed runs
        self._times: dict[tuple[int, int], list[float]] = {}  # (count, round) -> step seconds
        self.probes = 0
        self.switches = 0
        self.last_ratios: dict[int, float] = {}  # each count's median step ratio, last probe

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
        count, round_, counted = self._step
        if counted:
            self._times.setdefault((count, round_), []).append(seconds)
        if not self._plan:
            self._decide()

    def _start_probe(self) -> None:
        self._times = {}
        for round_ in range(self.blocks):
            for count in self.candidates:
                block = [(count, round_, False)] + [(count, round_, True)] * (self.block_steps - 1)
                self._plan += block

    def _decide(self) -> None:
        mean = {key: _trimmed_mean(times) for key, times in self._times.items()}
        self.last_ratios = {
            count: statistics.median(
                mean[count, r] / max(mean[self.current, r], 1e-12) for r in range(self.blocks)
            )
            for count in self.candidates
        }
        self.probes += 1
        best = min(self.last_ratios, key=self.last_ratios.__getitem__)
        if self.last_ratios[best] >= 1 - self.margin:
            self._hold = min(self._hold * 2, self.hold_seconds * MAX_HOLD_FACTOR)
        else:
            log.info(
                "engine threads %d -> %d (median step ratio to %d: %s)",
                self.current,
                best,
                self.current,
                ", ".join(f"{c}: {r:.2f}" for c, r in sorted(self.last_ratios.items())),
            )
            self._hold = self.hold_seconds
            self.current = best
            self.switches += 1
        self._probe_at = self._clock() + self._hold


def _trimmed_mean(times: list[float]) -> float:
    kept = sorted(times)[: max(1, len(times) - int(len(times) * TRIM))]
    return sum(kept) / len(kept)
