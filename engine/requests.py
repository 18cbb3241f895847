"""Plain-data messages between the coordinator and the workers (they cross Ray calls)."""

from __future__ import annotations

from typing import NamedTuple

from engine.outputs import SeqUpdate
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason


class WorkRequest(NamedTuple):
    """A request as a worker receives it. `output_ids` are tokens it already generated elsewhere
    (a request resumed after its decode worker died); they count as output, not prompt."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = []

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]


class TokenUpdate(NamedTuple):
    """New tokens of one request from a worker. `first_index` is the output position of
    `token_ids[0]`, so the coordinator can drop repeats and notice gaps after a retry."""

    request_id: str
    first_index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_seconds: float | None = None
    error: str | None = None  # the worker lost the request (failed transfer); retry it

    @classmethod
    def of(cls, update: SeqUpdate) -> TokenUpdate:
        return cls(
            request_id=update.request_id,
            first_index=update.num_output_tokens - len(update.new_token_ids),
            token_ids=update.new_token_ids,
            logprobs=update.new_logprobs,
            finish_reason=update.finish_reason,
            stop_token_id=update.stop_token_id,
            num_prompt_tokens=update.num_prompt_tokens,
            num_cached_tokens=update.num_cached_tokens,
            queue_seconds=update.queue_seconds,
        )
