"""ModelLimits: the facts about a served model that every request is checked against, on
whichever process first sees the request (HTTP front end, coordinator or engine)."""

from __future__ import annotations

from typing import NamedTuple

from protocol.errors import RequestError
from protocol.sampling import SamplingParams

# Prompt tokens x (alternatives + 1) one request may ask the logprobs of: ~14 bytes each on the
# wire (protocol/wire.py), so a few such requests fit one update frame of MAX_FRAME_BYTES.
MAX_PROMPT_SCORES = 1_000_000


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

    def check_scores(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestError for prompt logprobs too many to carry in one update frame."""
        if params.prompt_logprobs is None:
            return
        entries = len(prompt_ids) * (params.prompt_logprobs + 1)
        if entries > MAX_PROMPT_SCORES:
            raise RequestError(
                f"prompt logprobs for {len(prompt_ids)} tokens with {params.prompt_logprobs} "
                f"alternatives each are {entries} entries; at most {MAX_PROMPT_SCORES} (fewer "
                "alternatives, or a shorter prompt)"
            )
