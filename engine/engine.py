"""LLMEngine: the step loop of one colocated engine, in token ids. `step()` = schedule, run, update.

Not thread-safe: one thread owns an engine (`engine.engine_thread.EngineThread`); every other
thread reaches it by submitting calls to that thread.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import NamedTuple

import torch

from engine.block_manager import BlockManager
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.gpu_memory import kv_budget
from engine.kv_cache import num_blocks_for_budget
from engine.parallel import TPShard, shard_for
from engine.runner import ModelRunner
from engine.sampler import SampleRow, prompt_logprobs, sample, uniform
from engine.scheduler import Scheduler, SchedulerConfig, StepPlan, fits_with_headroom
from engine.sequence import Sequence, SequenceStatus
from engine.stop import blocked_tokens, check_stop
from engine.structured import Structures, left_blocked
from engine.tensor_parallel import Launcher
from protocol.errors import RequestError
from protocol.kv import KVLayout
from protocol.limits import ModelLimits
from protocol.messages import RequestFailed, TokenUpdate, WorkerUpdate
from protocol.sampling import FinishReason, SamplingParams, TokenLogprobs
from protocol.stats import EngineSnapshot
from protocol.telemetry import PREFIX_LOG_SIZE, STEP_LOG_SIZE, PrefixEvent, SeqLog, StepRecord

log = logging.getLogger(__name__)


class Reservation(NamedTuple):
    block_table: tuple[int, ...]  # covers every token of the request
    num_cached_tokens: int  # leading tokens whose KV this engine already holds


# How long a step with nothing to run but requests waiting for their grammar waits for one.
COMPILE_POLL_S = 0.01  # (calls from other threads wait for the step that long at most)
PlanLayerHook = Callable[[StepPlan, int], None]
PlanHook = Callable[[StepPlan], object]


def skip_draws(generator: torch.Generator, count: int) -> None:
    """Advances a request's generator past `count` sampled tokens (one `uniform` draw each, as
    the sampler takes them), so a resumed request continues its random stream."""
    for _ in range(count):
        uniform(generator)


def _generator_states(rows: list[SampleRow]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The state of every generator a random row draws from, to undo a failed batch."""
    generators = {id(r.generator): r.generator for r in rows if not r.params.greedy}
    return [(g, g.get_state()) for g in generators.values() if g is not None]


class LLMEngine:
    def __init__(self, config: EngineConfig, launch_ranks: Launcher | None = None) -> None:
        """`launch_ranks` starts the other tensor-parallel ranks (engine/tensor_parallel.py);
        local processes when None."""
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        dtype = getattr(torch, config.dtype)
        shard = shard_for(self.model_config, config.tensor_parallel_size, 0)
        self.num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            self.model_config, config.block_size, dtype, self._kv_budget(shard), shard
        )
        self.max_model_len = self._max_model_len()
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        self.limits = ModelLimits(self.max_model_len, self.model_config.vocab_size)
        self.runner = ModelRunner(self.model_config, config, self.num_blocks, launch_ranks)
        self.blocks = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.step_log: SeqLog[StepRecord] = SeqLog(STEP_LOG_SIZE)
        self.prefix_log: SeqLog[PrefixEvent] = SeqLog(PREFIX_LOG_SIZE)
        self.blocks.on_cache_change = self._prefix_changed
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.late_after_s,
                config.share_prefill,
            ),
            self.blocks,
        )
        self.sequences: dict[str, Sequence] = {}  # queued or running here
        # queued here, held out of the scheduler until their response format has compiled
        self.compiling: dict[str, Sequence] = {}
        self.reserved: dict[str, Sequence] = {}  # blocks held, KV arriving from elsewhere
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator().manual_seed(config.seed)
        # Response formats: grammars compiled off this thread as requests arrive, and matchers
        # (made on a structured request's first sample).
        self.structures = Structures(self.model_config.path, self.model_config.vocab_size)
        log.info("engine ready: %d KV blocks of %d tokens", self.num_blocks, config.block_size)

    def _kv_budget(self, shard: TPShard) -> int:
        config = self.config
        if config.gpu_memory_utilization is None or not config.device.startswith("cuda"):
            return config.kv_cache_memory_bytes
        budget = kv_budget(self.model_config, config, shard)
        log.info("KV pool: %.2f GiB of the GPU", budget / 2**30)
        return budget

    def _max_model_len(self) -> int:
        limit = self.config.max_model_len or self.model_config.max_model_len
        if limit > self.model_config.max_model_len:
            raise ConfigError(
                f"max_model_len {limit} exceeds the model's {self.model_config.max_model_len}"
            )
        # One sequence must always fit in the pool, or preemption could not make room for it.
        return min(limit, self.num_blocks * self.config.block_size)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: Sequence_[int] = (),
        age_s: float = 0.0,
    ) -> None:
        """Queues a request for prefill here. `output_ids` resumes a request that already
        generated those tokens elsewhere: they count as output (penalties, max_tokens, seeds).
        `age_s`: how long ago the request arrived (it waited elsewhere before it came here)."""
        if output_ids and params.prompt_logprobs is not None:  # they went with its first token
            params = dataclasses.replace(params, prompt_logprobs=None)
        seq = self._new_sequence(request_id, prompt_ids, params, output_ids)
        seq.arrival_time -= age_s
        if params.structure is None or self.structures.ready(params.structure):
            self.scheduler.add(seq)
        else:
            self.compiling[request_id] = seq

    def _new_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: Sequence_[int],
    ) -> Sequence:
        if request_id in self.sequences or request_id in self.reserved:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.check_request([*prompt_ids, *output_ids], params)
        seq = Sequence(request_id, [*prompt_ids, *output_ids], len(prompt_ids), params)
        if params.structure is not None:  # a reservation's compiles while its KV is on its way
            self.structures.prepare(params.structure)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token's (a one-token prompt's only one)
        self.sequences[request_id] = seq
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
            if not params.greedy:
                skip_draws(generator, len(output_ids))
            self.generators[request_id] = generator
        return seq

    def reserve(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: Sequence_[int] = (),
    ) -> Reservation | None:
        """Holds blocks for a request whose KV another worker computes; None when they do not
        fit now with `decode_headroom_tokens` of growth left for every request here. Prefix-cache
        hits are taken here and need not be sent."""
        if params.prompt_logprobs is not None:  # the worker computing the KV scores the prompt
            params = dataclasses.replace(params, prompt_logprobs=None)
        seq = self._new_sequence(request_id, prompt_ids, params, output_ids)
        del self.sequences[request_id]
        hits = self.blocks.match_prefix(seq.token_ids, seq.block_hashes)
        # (the waiting ones too: a preempted or locally queued request is ahead in line, and
        # counted out it lost every block and seat a finish freed to the next reservation)
        held = (*self.scheduler.running, *self.reserved.values(), *self.scheduler.waiting)
        headroom = self.config.decode_headroom_tokens
        fits = fits_with_headroom(self.blocks, held, seq, hits, headroom)
        block_table = self.blocks.allocate_prefix(hits, seq.num_tokens) if fits else None
        if block_table is None:
            self.generators.pop(request_id, None)
            self.structures.forget(request_id)
            return None
        num_cached = min(len(hits) * self.config.block_size, seq.num_tokens)
        self.blocks.count_query(seq.num_tokens, num_cached)
        seq.block_table = block_table
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_prompt_tokens = num_cached
        # (no first_scheduled_time: its queue time is its prefill worker's, which reports it)
        self.reserved[request_id] = seq
        return Reservation(tuple(seq.block_table), num_cached)

    def admit(
        self, request_id: str, token_id: int, logprobs: TokenLogprobs | None = None
    ) -> TokenUpdate:
        """A reserved request's KV has arrived with its next token: it joins the running batch
        (or finishes at once if that token stops it)."""
        seq = self.reserved.pop(request_id)
        self.sequences[request_id] = seq
        generator = self.generators.get(request_id)
        if generator is not None and not seq.params.greedy:
            skip_draws(generator, 1)  # the prefill worker's draw for `token_id`
        self.scheduler.add_running(seq)
        update = self._update([seq], [token_id], [logprobs])[0]
        structure = seq.params.structure
        if structure is not None and not seq.is_finished and not self.structures.ready(structure):
            self.scheduler.hold(seq)  # its KV came before its grammar: it samples once that has
            self.compiling[request_id] = seq
        return update

    def release(self, request_id: str) -> bool:
        """Drops a reservation (transfer failed or expired); False if there is none."""
        seq = self.reserved.pop(request_id, None)
        self.generators.pop(request_id, None)
        self.structures.forget(request_id)
        if seq is None:
            return False
        self.blocks.free_blocks(seq.block_table)
        seq.block_table = []
        return True

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raises RequestError (or SamplingError) for a request this engine cannot serve. Reads
        only fixed facts, so any thread may call it."""
        self.limits.check_prompt(prompt_ids)
        if params is not None:
            self.limits.check_params(params)
            self.limits.check_scores(prompt_ids, params)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; False if it is unknown or already finished."""
        if self.release(request_id):
            return True
        seq = self.sequences.pop(request_id, None)
        self.generators.pop(request_id, None)
        self.structures.forget(request_id)
        if seq is None:
            return False
        held = self.compiling.pop(request_id, None)
        if held is not None and held.status is SequenceStatus.RUNNING:
            self.scheduler.resume(held)  # admitted with its KV: finish frees its blocks
        elif held is not None:
            return True  # waiting for its grammar before its prefill: it holds no blocks
        self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def close(self) -> None:
        """Ends the tensor-parallel follower ranks, if any; the engine cannot step after."""
        self.runner.close()

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.runner.kv_caches

    @property
    def kv_layout(self) -> KVLayout:
        cfg = self.model_config
        return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.config.dtype)

    def has_room(self, num_reserved: int = 0) -> bool:
        """Whether another sequence may join the running batch (`num_reserved` more are
        promised to it already): after the ones waiting here, which are ahead in line."""
        held = self._num_held() + len(self.scheduler.waiting)
        return len(self.scheduler.running) + held + num_reserved < self.config.max_num_seqs

    def snapshot(self) -> EngineSnapshot:
        """Counts for stats and routing. Any thread may call it: each container is copied in
        one step under the GIL, so the counts may be a step stale but never torn."""
        blocks = self.blocks
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        for seq in list(self.compiling.values()):  # waiting for their grammar
            (running if seq.status is SequenceStatus.RUNNING else waiting).append(seq)
        in_prefill = [s for s in running if s.num_uncomputed_tokens > 1]
        return EngineSnapshot(
            num_running=len(running),
            num_waiting=len(waiting),
            queued_prefill_tokens=sum(s.num_uncomputed_tokens for s in (*in_prefill, *waiting)),
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=blocks.num_blocks,
            prefix_cache_queries=blocks.prefix_queries,
            prefix_cache_hits=blocks.prefix_hits,
        )

    def abort_all(self) -> list[str]:
        """Stops every request and reservation here (a worker changing roles); their ids."""
        request_ids = [*self.sequences, *self.reserved]
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    @property
    def has_unfinished(self) -> bool:
        """Work for `step()`: queued or running requests (reservations wait for their KV)."""
        return self.scheduler.num_unfinished > 0 or bool(self.compiling)

    def step(
        self, on_layer: PlanLayerHook | None = None, on_plan: PlanHook | None = None
    ) -> list[WorkerUpdate]:
        """One model step. `on_plan(plan)` runs before the forward pass, and what it returns
        goes to the follower ranks with the batch; `on_layer(plan, i)` runs once layer i's KV
        of the plan is written. A request whose sampling raises fails alone (a
        RequestFailed); the rest go on."""
        failed = self._admit_compiled() if self.compiling else []
        started = time.perf_counter()
        threads = torch.get_num_threads()
        plan = self.scheduler.schedule(len(self.reserved) + self._num_held())
        if not plan.chunks:
            if self.compiling and not failed:  # nothing to run until a grammar is ready
                specs = {seq.params.structure for seq in self.compiling.values()}
                self.structures.wait(specs, COMPILE_POLL_S)  # type: ignore[arg-type]
            return failed
        try:
            return failed + self._run(plan, on_layer, on_plan)
        finally:
            self._record(plan, time.perf_counter() - started, threads)

    def _num_held(self) -> int:
        """Admitted sequences out of the batch until their grammar is ready: seats taken."""
        if not self.compiling:
            return 0
        return sum(seq.status is SequenceStatus.RUNNING for seq in list(self.compiling.values()))

    def _admit_compiled(self) -> list[WorkerUpdate]:
        """Requests whose grammar has compiled join the scheduler's queue, in arrival order;
        those whose grammar failed or ran out of time fail alone."""
        failed: list[WorkerUpdate] = []
        for request_id, seq in list(self.compiling.items()):
            structure = seq.params.structure
            assert structure is not None
            if not self.structures.ready(structure):
                continue
            try:
                self.structures.compile(structure)  # at once: ready
            except Exception as err:
                failed.append(self._fail_sampling(seq, err))  # (abort drops it from compiling)
                continue
            del self.compiling[request_id]
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.resume(seq)
            else:
                self.scheduler.add(seq)
        return failed

    def _run(
        self, plan: StepPlan, on_layer: PlanLayerHook | None, on_plan: PlanHook | None
    ) -> list[WorkerUpdate]:
        sampling = [chunk.seq for chunk in plan.chunks if chunk.samples]
        extra = on_plan(plan) if on_plan is not None else None
        hook = functools.partial(on_layer, plan) if on_layer is not None else None
        logits, prompts = self.runner.execute(plan, hook, extra)
        for seq, first, scores in prompts:
            targets = seq.token_ids[first + 1 : first + 1 + len(scores)]
            seq.prompt_logprobs += prompt_logprobs(scores, targets, seq.params.prompt_logprobs)
        self.scheduler.commit(plan)
        rows, kept, failed = [], [], []
        for i, seq in enumerate(sampling):
            try:
                rows.append(self._sample_row(seq))
                kept.append(i)
            except Exception as err:  # its response format cannot be used: it fails alone
                failed.append(self._fail_sampling(seq, err))
        if failed:
            sampling, logits = [sampling[i] for i in kept], logits[kept]
            if not sampling:
                return failed
        saved = _generator_states(rows)
        try:
            output = sample(logits, rows)
        except Exception:  # some row broke the batch: find it, keep the others
            for generator, state in saved:  # draws the failed batch made are not spent
                generator.set_state(state)
            return failed + self._sample_alone(sampling, logits, rows)
        return failed + self._update(sampling, output.token_ids, output.logprobs)

    def _record(self, plan: StepPlan, seconds: float, threads: int) -> None:
        blocks = self.blocks
        self.step_log.append(
            StepRecord(
                time.time(),
                seconds,
                *plan.shape(),
                blocks.num_blocks - blocks.num_free_blocks,
                len(self.scheduler.waiting),
                threads,
            )
        )

    def _prefix_changed(self, digests: list[int], stored: bool) -> None:
        self.prefix_log.extend([PrefixEvent(digest, stored) for digest in digests])

    def cached_prefixes(self) -> list[int]:
        """Every block hash in the prefix cache now. Any thread may call it (one copy)."""
        return list(self.blocks.hash_to_block)

    def _sample_alone(
        self, sampling: list[Sequence], logits: torch.Tensor, rows: list[SampleRow]
    ) -> list[WorkerUpdate]:
        """Samples each row by itself; a row that still raises fails its request only."""
        updates: list[WorkerUpdate] = []
        for i, (seq, row) in enumerate(zip(sampling, rows, strict=True)):
            try:
                output = sample(logits[i : i + 1], [row])
            except Exception as err:
                updates.append(self._fail_sampling(seq, err))
                continue
            updates.extend(self._update([seq], output.token_ids, output.logprobs))
        return updates

    def _fail_sampling(self, seq: Sequence, err: Exception) -> RequestFailed:
        """The request whose sampling raised ends here, with the reason; no retry elsewhere
        would sample it any better."""
        if isinstance(err, RequestError):
            log.warning("request %s: %s", seq.request_id, err)
        else:
            log.exception("sampling failed for request %s", seq.request_id)
        self.abort(seq.request_id)
        if isinstance(err, RequestError):
            return RequestFailed(seq.request_id, str(err), retry=False, invalid=True)
        reason = f"sampling failed: {type(err).__name__}: {err}"
        return RequestFailed(seq.request_id, reason, retry=False)

    def _sample_row(self, seq: Sequence) -> SampleRow:
        params, structure = seq.params, seq.params.structure
        # Only penalties read the token lists: copying a long prompt for every row of every
        # step was most of a large batch's host time between GPU steps.
        penalized = params.adjusts_logits
        blocked, allowed = blocked_tokens(seq, self.eos_ids), None
        if structure is not None:
            allowed = self.structures.allowed(seq.request_id, structure, seq.output_token_ids)
            blocked = left_blocked(allowed, blocked)
        return SampleRow(
            params=params,
            prompt_ids=seq.token_ids[: seq.num_prompt_tokens] if penalized else (),
            output_ids=seq.output_token_ids if penalized else (),
            blocked_ids=blocked,
            generator=self.generators.get(seq.request_id, self.default_generator),
            allowed=allowed,
        )

    def _update(
        self,
        sampling: list[Sequence],
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
    ) -> list[TokenUpdate]:
        updates = []
        for seq, token, token_logprobs in zip(sampling, token_ids, logprobs, strict=True):
            seq.token_ids.append(token)
            stop = check_stop(seq, self.eos_ids, self.max_model_len)
            if seq.params.structure is not None and self.structures.advance(seq.request_id, token):
                stop = stop or (FinishReason.STOP, None)  # the response format is complete
            if stop is not None:
                self.scheduler.finish(seq, stop[0])
                del self.sequences[seq.request_id]
                self.generators.pop(seq.request_id, None)
                self.structures.forget(seq.request_id)
            updates.append(
                TokenUpdate(
                    request_id=seq.request_id,
                    first_index=seq.num_output_tokens - 1,
                    token_ids=[token],
                    logprobs=[token_logprobs],
                    finish_reason=stop[0] if stop else None,
                    stop_token_id=stop[1] if stop else None,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_prompt_tokens,
                    queue_seconds=seq.queue_seconds,
                    prompt_logprobs=seq.prompt_logprobs if seq.num_output_tokens == 1 else None,
                )
            )
        return updates
