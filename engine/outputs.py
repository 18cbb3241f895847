"""What the engine core reports per step, and what frontends hand to users."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampler import TokenLogprobs
from engine.sequence import FinishReason


@dataclass(frozen=True)
class SeqUpdate:
    """New tokens of one request after an engine step (token ids only; no text yet)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None
    stop_token_id: int | None  # the token that stopped it, when one did
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_seconds: float | None = None  # arrival until the request first got KV blocks
    num_output_tokens: int = 0  # the request's output length after this update


@dataclass
class RequestOutput:
    """A request's state as a user sees it: tokens, text, and the part new since last time."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    num_cached_tokens: int = 0
    queue_seconds: float | None = None  # arrival until the request first got KV blocks

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
