"""Sequence: one request's tokens and its place in the KV cache, as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from protocol.sampling import FinishReason, PromptLogprob, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens [0, num_computed_tokens) have KV in the blocks of `block_table`.

    Only the engine loop mutates a Sequence; schedulers read counts and write block tables.
    """

    request_id: str
    token_ids: list[int]  # prompt, then the output so far
    num_prompt_tokens: int
    params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    # chained hashes of its first full blocks, computed once (block_manager.chain_hashes)
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when its KV first got blocks
    # With params.prompt_logprobs: prompt token i's logprobs given the tokens before it, as
    # far as computed (entry 0, the first token, has none: None).
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def queue_seconds(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_uncomputed_prompt_tokens(self) -> int:
        return max(0, self.num_prompt_tokens - self.num_computed_tokens)

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed yet: its prompt must be
        computed, not taken from the prefix cache."""
        if self.params.prompt_logprobs is None:
            return False
        return self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens

    def prompt_positions(self, start: int, end: int) -> range:
        """The positions of [start, end) whose logits score the prompt's next token and are
        not scored yet (a recomputation after preemption scores nothing twice)."""
        if not self.scores_prompt:
            return range(0)
        done = len(self.prompt_logprobs or [None]) - 1  # positions scored so far
        return range(max(start, done), min(end, self.num_prompt_tokens - 1))

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
