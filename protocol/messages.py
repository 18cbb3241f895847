"""Messages between the coordinator and the workers (they cross Ray calls as plain data)."""

from __future__ import annotations

from typing import NamedTuple

from protocol.errors import InvalidOutputError, RequestFailedError
from protocol.sampling import FinishReason, PromptLogprob, SamplingParams, TokenLogprobs


class WorkRequest(NamedTuple):
    """A request as a worker receives it. `output_ids` are tokens it already generated elsewhere
    (a request resumed after its worker died); they count as output, not prompt. `age_s`: how
    long ago it reached the coordinator, so the worker knows when it arrived on its own clock
    (a scheduler with a TTFT objective serves the newest first once the oldest is late)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = []
    age_s: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]


class TokenUpdate(NamedTuple):
    """New tokens of one request, the one per-token message from an engine step to whoever
    follows the request. `first_index` is the output position of `token_ids[0]`, so a reader
    can drop repeats and notice gaps after a retry."""

    request_id: str
    first_index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the token that stopped it, when one did
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_seconds: float | None = None  # arrival until the request first got KV blocks
    # With the first output token, when SamplingParams.prompt_logprobs asked: one per prompt
    # token (None for the first, which nothing comes before).
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def num_output_tokens(self) -> int:
        """The request's output length once this update is applied."""
        return self.first_index + len(self.token_ids)


class RequestFailed(NamedTuple):
    """A worker lost one request (its KV never arrived, or its own step failed on it). `retry`
    says whether another attempt can succeed; a request that broke the sampler cannot.
    `corrupt`: its KV arrived but failed its checksum (nothing was decoded from it).
    `invalid`: the request itself is at fault (a response format xgrammar cannot compile): the
    client gets a 400, not a server error."""

    request_id: str
    reason: str
    retry: bool = True
    corrupt: bool = False
    invalid: bool = False

    def error(self) -> Exception:
        """What the request fails with, for one that cannot be retried."""
        return InvalidOutputError(self.reason) if self.invalid else RequestFailedError(self.reason)


WorkerUpdate = TokenUpdate | RequestFailed


class PrefillResult(NamedTuple):
    """A prefill worker's answer once a request's KV and first token are with its decode
    worker: what the coordinator needs to stream that token at once."""

    request_id: str
    token_id: int  # the token sampled after the prompt (output index len(output_ids))
    logprobs: TokenLogprobs | None
    num_cached_tokens: int  # prompt tokens the prefill worker found in its own prefix cache
    bytes_sent: int
    # Seconds from the end of the step that sampled `token_id` to this answer, on the prefill
    # worker's own clock (a duration: hosts' clocks differ): where the handover to the client
    # starts (tandem:kv_handover_seconds)
    age_s: float | None = None
    # arrival at the coordinator until the prefill worker gave it KV blocks: its queue time (a
    # decode worker that receives the KV reports none)
    queue_seconds: float | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None  # TokenUpdate.prompt_logprobs
