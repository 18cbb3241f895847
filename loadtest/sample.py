"""One prompt of a workload, as every dataset produces it."""

from __future__ import annotations

from typing import NamedTuple


class SampleRequest(NamedTuple):
    prompt: str
    prompt_len: int  # tokens, measured with the target model's tokenizer
    expected_output_len: int  # sent as max_tokens
