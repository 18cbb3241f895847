"""The measurements behind `tandem profile`: exact step shapes driven through one in-process engine.

Three kinds of shape, each repeated and reduced to its median record:

- decode ladders: `max_batch` sequences prefilled once to a context, then decode steps at batch
  sizes stepping down the ladder (aborting sequences between rungs). One prefill of unique
  contexts serves every batch size, and contexts stay unique, so decode attention reads as much
  memory as in serving (a shared prefix would sit in cache and read faster);
- prompt chunks of T tokens after a cached prefix of O tokens (prefix caching computes only the
  T new ones), so prompt attention is measured at context > chunk;
- mixed steps: a ladder rung's decodes plus one prompt chunk (the prompt asks for one token, so it
  finishes in that step and the rung's batch stays put).

Shapes marked held out never reach the fit: other batch sizes, chunk sizes and contexts than
the training shapes, so the held-out error says how the model does between measured points.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from cli import cpu_watch
from planning.cost_model import ProfileInfo
from planning.records import median_record
from protocol.sampling import SamplingParams
from protocol.telemetry import StepRecord

if TYPE_CHECKING:
    from engine.engine import LLMEngine

LOWEST_TOKEN_ID = 100  # below are the special tokens of most vocabularies
KV_POOL_SHARE = 0.8  # of the KV pool a ladder may fill; the rest holds prompts and the prefix cache


class Ladder(NamedTuple):
    context: int  # tokens each sequence holds before the first rung
    batches: tuple[int, ...]  # rungs; tried in descending order, those above the pool skipped
    heldout_batches: tuple[int, ...]  # measured in the same ladder, never fitted
    mixed_chunks: tuple[int, ...]  # a prompt chunk of each size joins the rungs in `mixed_at`
    mixed_at: tuple[int, ...]


class PromptShape(NamedTuple):
    chunk: int  # new tokens computed in the step
    cached: int  # tokens of the prompt already in the prefix cache (a multiple of block size)
    heldout: bool


class SweepPlan(NamedTuple):
    ladders: tuple[tuple[Ladder, bool], ...]  # (ladder, every rung held out)
    prompts: tuple[PromptShape, ...]
    decode_steps: int  # steps measured per rung (the median is kept)
    repeats: int  # measurements per prompt or mixed shape
    passes: int  # times the whole plan runs, minutes apart


class Measurement(NamedTuple):
    label: str
    record: StepRecord  # the median of the repeats
    heldout: bool


class SweepSettings(NamedTuple):
    """What `tandem profile` asks of a sweep, wherever it runs."""

    dtype: str
    device: str  # "cpu" or "cuda"
    threads: int | None  # torch threads; None: torch's
    max_batch: int
    tensor_parallel: int
    quick: bool


class StepSweep(NamedTuple):
    measured: list[Measurement]
    info: ProfileInfo  # the setup measured, for the profile file


BATCHES = (64, 48, 32, 24, 16, 12, 8, 4, 2, 1)
HELDOUT_BATCHES = (56, 40, 20, 14, 6, 3)
SWEEP_BUDGET = 2048  # tokens a sweep step may hold: the largest chunk below

FULL = SweepPlan(
    ladders=(
        (Ladder(32, BATCHES, HELDOUT_BATCHES, (64, 512), (32, 16, 8)), False),
        (Ladder(384, BATCHES, HELDOUT_BATCHES, (256,), (24, 4)), False),
        (Ladder(1024, BATCHES, HELDOUT_BATCHES, (), ()), False),
        (Ladder(640, (40, 20, 10, 5), (), (128,), (20,)), True),
    ),
    prompts=(
        *(PromptShape(t, 0, False) for t in (2, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)),
        *(PromptShape(t, o, False) for t in (64, 256, 1024) for o in (512, 1536)),
        *(PromptShape(t, 0, True) for t in (12, 24, 48, 96, 384, 768, 1536)),
        *(PromptShape(t, 1024, True) for t in (192, 640)),
    ),
    decode_steps=5,
    repeats=3,
    passes=2,
)
QUICK = SweepPlan(
    ladders=(
        (Ladder(32, (16, 8, 4, 2, 1), (12, 3), (64,), (8,)), False),
        (Ladder(128, (8, 2), (), (), ()), True),
    ),
    prompts=(
        *(PromptShape(t, 0, False) for t in (16, 64, 256)),
        PromptShape(64, 128, False),
        PromptShape(48, 0, True),
    ),
    decode_steps=3,
    repeats=3,
    passes=1,
)


def fastest_pass(passes: list[list[Measurement]]) -> list[Measurement]:
    """Per shape (label), the pass whose median was fastest, in the first pass's order.

    On a shared machine another process can slow every repeat of a shape for seconds on end,
    which no median of back-to-back repeats removes; such noise only ever adds time, so of
    passes run far apart the fastest is the one least disturbed."""
    best: dict[str, Measurement] = {}
    for measured in passes:
        for m in measured:
            if m.label not in best or m.record.seconds < best[m.label].record.seconds:
                best[m.label] = m
    return list(best.values())


class Sweep:
    """Drives `engine` (prefix caching on, nothing else running) through a SweepPlan."""

    def __init__(self, engine: LLMEngine, max_batch: int, seed: int = 0) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.next_id = 0
        self.capacity = int(engine.num_blocks * engine.config.block_size * KV_POOL_SHARE)
        self.others_cores: list[float | None] = []  # per pass, when the OS tells

    def run(self, plan: SweepPlan, log: Callable[[str], None]) -> list[Measurement]:
        """Every shape of `plan`, measured `plan.passes` times; per shape the fastest pass."""
        self.warm_up()
        passes = []
        for number in range(plan.passes):
            log(f"pass {number + 1} of {plan.passes}")
            start = cpu_watch.sample()
            passes.append(self.one_pass(plan, log))
            others = cpu_watch.others_cores(start, cpu_watch.sample())
            self.others_cores.append(others)
            if others is not None:
                log(f"pass {number + 1}: other processes used {others:.2f} cores meanwhile")
        return fastest_pass(passes)

    def one_pass(self, plan: SweepPlan, log: Callable[[str], None]) -> list[Measurement]:
        measured: list[Measurement] = []
        for ladder, heldout in plan.ladders:
            log(f"decode ladder at context {ladder.context}")
            measured += self.ladder(ladder, heldout, plan)
        # A chunk over the token budget would be split over steps.
        budget = self.engine.config.max_num_batched_tokens
        limit = self.engine.max_model_len
        prompts = [s for s in plan.prompts if s.chunk <= budget and s.cached + s.chunk < limit]
        log(f"{len(prompts)} prompt chunk shapes")
        measured += [self.prompt(shape, plan.repeats) for shape in prompts]
        return measured

    def warm_up(self) -> None:
        """One pass over the kernels' paths (AMX and oneDNN rows, prompt and decode attention),
        so first-call costs (oneDNN primitives, the C++ kernels' load) stay out of the fit."""
        ladder = Ladder(32, (min(self.max_batch, 24), 1), (), (32,), (1,))
        self.ladder(ladder, False, SweepPlan((), (), decode_steps=2, repeats=2, passes=1))
        longest = min(512, self.engine.config.max_num_batched_tokens, self.engine.max_model_len - 1)
        self.prompt(PromptShape(longest, 0, False), 2)

    def ladder(self, ladder: Ladder, heldout: bool, plan: SweepPlan) -> list[Measurement]:
        rungs, max_tokens = self._rungs(ladder, heldout, plan)
        if not rungs:
            return []
        ids = [self._add(self._tokens(ladder.context), max_tokens) for _ in range(rungs[0][0])]
        while self.engine.scheduler.waiting or self._prefilling():
            self.engine.step()
        measured = []
        for batch, rung_heldout in rungs:
            while len(ids) > batch:
                self.engine.abort(ids.pop())
            label = f"decode {batch:3d} x ctx {ladder.context}"
            records = self._steps(plan.decode_steps)
            measured.append(Measurement(label, median_record(records), rung_heldout))
            if batch in ladder.mixed_at:
                measured += self._mixed(ladder, batch, rung_heldout, plan.repeats)
        for request_id in ids:
            self.engine.abort(request_id)
        return measured

    def _rungs(
        self, ladder: Ladder, heldout: bool, plan: SweepPlan
    ) -> tuple[list[tuple[int, bool]], int]:
        """([(batch, held out)] largest first, the max_tokens that keeps every sequence running
        until the ladder aborts it), leaving out batches the KV pool or the context cannot hold."""
        listed = (*ladder.batches, *ladder.heldout_batches)
        # A --max-batch past the plan's batches is measured too, on the training ladders.
        beyond = (self.max_batch,) if not heldout and self.max_batch > max(listed) else ()
        sizes = [b for b in (*listed, *beyond) if b <= self.max_batch]
        # The first sequences prefilled decode while the rest prefill; then every rung steps all.
        budget = self.engine.config.max_num_batched_tokens
        prefill_steps = -(-max(sizes, default=0) * (ladder.context + 1) // budget) + 1
        rung_steps = plan.decode_steps + len(ladder.mixed_chunks) * plan.repeats
        max_tokens = prefill_steps + rung_steps * len(sizes) + 2
        longest = ladder.context + max_tokens
        fitting = [b for b in sizes if b * longest <= self.capacity]
        if longest > self.engine.max_model_len:
            fitting = []
        rungs = [(b, heldout or b in ladder.heldout_batches) for b in sorted(fitting)[::-1]]
        return rungs, max_tokens

    def _mixed(self, ladder: Ladder, batch: int, heldout: bool, repeats: int) -> list[Measurement]:
        measured = []
        budget = self.engine.config.max_num_batched_tokens
        for chunk in (c for c in ladder.mixed_chunks if batch + c <= budget):
            records = []
            for _ in range(repeats):
                self._add(self._tokens(chunk), 1)
                records += self._steps(1)
            label = f"decode {batch:3d} x ctx {ladder.context} + prompt {chunk}"
            measured.append(Measurement(label, median_record(records), heldout))
        return measured

    def prompt(self, shape: PromptShape, repeats: int) -> Measurement:
        prefix = self._tokens(shape.cached)
        if shape.cached:
            self._add(prefix, 1)
            self._drain()
        records = []
        for _ in range(repeats):
            self._add(prefix + self._tokens(shape.chunk), 1)
            records += self._drain()
        label = f"prompt {shape.chunk} after {shape.cached} cached"
        return Measurement(label, median_record(records), shape.heldout)

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        request_id = f"profile-{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, prompt, params)
        return request_id

    def _tokens(self, count: int) -> list[int]:
        """Random ids: no two prompts share a block, so the prefix cache only hits on purpose."""
        return [self.rng.randrange(LOWEST_TOKEN_ID, self.vocab) for _ in range(count)]

    def _prefilling(self) -> bool:
        return any(s.num_uncomputed_tokens > 1 for s in self.engine.scheduler.running)

    def _steps(self, count: int) -> list[StepRecord]:
        start = self.engine.step_log.since(0)[0]
        for _ in range(count):
            self.engine.step()
        return self.engine.step_log.since(start)[1]

    def _drain(self) -> list[StepRecord]:
        start = self.engine.step_log.since(0)[0]
        while self.engine.has_unfinished:
            self.engine.step()
        return self.engine.step_log.since(start)[1]


def measure_steps(folder: Path, settings: SweepSettings, log: Callable[[str], None]) -> StepSweep:
    """Loads the model in this process and sweeps its steps: the part of `tandem profile` that
    runs where the steps will run (here, or on a cluster's worker node)."""
    import torch

    from engine.llm import LLM
    from kernels.threads import use_threads

    if settings.threads is not None:
        use_threads(settings.threads)
    # One sequence more than the largest batch: a mixed step's prompt joins a full rung. The
    # budget fits the sweep's largest chunk, whatever a server on this device takes by default:
    # the cost model must price any budget the deployment is given.
    llm = LLM(
        folder,
        dtype=settings.dtype,
        device=settings.device,
        tensor_parallel_size=settings.tensor_parallel,
        max_num_seqs=settings.max_batch + 1,
        max_num_batched_tokens=SWEEP_BUDGET,
        enable_prefix_caching=True,
    )
    try:
        sweep = Sweep(llm.engine, settings.max_batch)
        measured = sweep.run(QUICK if settings.quick else FULL, log=log)
    finally:
        llm.close()
    config = llm.engine.config
    info = ProfileInfo(
        model=folder.name,
        dtype=config.dtype,
        device=config.device,
        threads=torch.get_num_threads(),
        block_size=config.block_size,
        source="sweep",
        others_cores=min((c for c in sweep.others_cores if c is not None), default=None),
        host=socket.gethostname(),
        tensor_parallel=config.tensor_parallel_size,
    )
    return StepSweep(measured, info)
