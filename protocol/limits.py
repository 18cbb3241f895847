"""ModelLimits: the facts about a served model that every request is checked against, on
whichever process first sees the request (HTTP front end, coordinator or engine)."""

from __future__ import annotations

from typing import NamedTuple

from protocol.errors import RequestError
from protocol.sampling import SamplingParams


class ModelLimits(NamedTuple):
    max_model_len: int  # prompt + output tokens one request may hold
    vocab_size: int

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raises RequestError for a prompt that is empty, too long or holds unknown ids."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; this server serves at most "
                f"{self.max_model_len} tokens of context, prompt and output together"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})")

    def check_params(self, params: SamplingParams) -> None:
        """Raises SamplingError for sampling fields that point past this model."""
        params.check_vocab(self.vocab_size)
