"""LLMEngine: the step loop of one colocated engine, in token ids. `step()` = schedule, run, update.

Not thread-safe: one thread owns an engine (`AsyncEngine` runs it in its own thread).
"""

from __future__ import annotations

import logging

import torch

from engine.block_manager import BlockManager
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.kv_cache import num_blocks_for_budget
from engine.outputs import SeqUpdate
from engine.runner import DTYPES, ModelRunner
from engine.sampler import SampleRow, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence
from engine.stop import blocked_tokens, check_stop

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request this engine cannot take (too long, duplicate id, empty prompt)."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        dtype = DTYPES[config.dtype]
        self.num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            self.model_config, config.block_size, dtype, config.kv_cache_memory_bytes
        )
        self.max_model_len = self._max_model_len()
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        self.runner = ModelRunner(self.model_config, config, self.num_blocks)
        self.blocks = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.blocks
        )
        self.sequences: dict[str, Sequence] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator().manual_seed(config.seed)
        log.info("engine ready: %d KV blocks of %d tokens", self.num_blocks, config.block_size)

    def _max_model_len(self) -> int:
        limit = self.config.max_model_len or self.model_config.max_model_len
        if limit > self.model_config.max_model_len:
            raise ConfigError(
                f"max_model_len {limit} exceeds the model's {self.model_config.max_model_len}"
            )
        # One sequence must always fit in the pool, or preemption could not make room for it.
        return min(limit, self.num_blocks * self.config.block_size)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.sequences:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_ids)
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params)
        self.sequences[request_id] = seq
        if params.seed is not None:
            self.generators[request_id] = torch.Generator().manual_seed(params.seed)
        self.scheduler.add(seq)

    def check_request(self, prompt_ids: list[int]) -> None:
        """Raises RequestError for a prompt this engine cannot serve. Reads only fixed facts, so
        any thread may call it."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; this engine serves at most "
                f"{self.max_model_len} tokens of context, prompt and output together"
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; False if it is unknown or already finished."""
        seq = self.sequences.pop(request_id, None)
        self.generators.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[SeqUpdate]:
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        sampling = [chunk.seq for chunk in plan.chunks if chunk.samples]
        output = self.runner.execute(plan, [self._sample_row(seq) for seq in sampling])
        self.scheduler.commit(plan)
        return self._update(sampling, output.token_ids, output.logprobs)

    def _sample_row(self, seq: Sequence) -> SampleRow:
        return SampleRow(
            params=seq.params,
            prompt_ids=seq.token_ids[: seq.num_prompt_tokens],
            output_ids=seq.output_token_ids,
            blocked_ids=blocked_tokens(seq, self.eos_ids),
            generator=self.generators.get(seq.request_id, self.default_generator),
        )

    def _update(
        self,
        sampling: list[Sequence],
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
    ) -> list[SeqUpdate]:
        updates = []
        for seq, token, token_logprobs in zip(sampling, token_ids, logprobs, strict=True):
            seq.token_ids.append(token)
            stop = check_stop(seq, self.eos_ids, self.max_model_len)
            if stop is not None:
                self.scheduler.finish(seq, stop[0])
                del self.sequences[seq.request_id]
                self.generators.pop(seq.request_id, None)
            updates.append(
                SeqUpdate(
                    request_id=seq.request_id,
                    new_token_ids=[token],
                    new_logprobs=[token_logprobs],
                    finish_reason=stop[0] if stop else None,
                    stop_token_id=stop[1] if stop else None,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_prompt_tokens,
                )
            )
        return updates
