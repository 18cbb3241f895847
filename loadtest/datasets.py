"""The prompts a benchmark sends. Each workload is one function from its spec to a list of
`SampleRequest`s; token lengths are always measured with the target model's tokenizer."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from loadtest.config import DatasetConfig, MixedSpec, PrefixRepetitionSpec, RandomSpec, ShareGPTSpec
from loadtest.prompts import synthesize_text
from loadtest.sample import SampleRequest
from loadtest.sharegpt import sample_sharegpt
from loadtest.token_count import TokenCounter


def sample_requests(config: DatasetConfig, counter: TokenCounter) -> list[SampleRequest]:
    samplers: dict[type, Callable[..., list[SampleRequest]]] = {
        RandomSpec: sample_random,
        ShareGPTSpec: sample_sharegpt,
        PrefixRepetitionSpec: sample_prefix_repetition,
        MixedSpec: sample_mixed,
    }
    rng = np.random.default_rng(config.seed)
    return samplers[type(config.spec)](config.spec, config.num_prompts, rng, counter)


def sample_random(
    spec: RandomSpec, num_prompts: int, rng: np.random.Generator, counter: TokenCounter
) -> list[SampleRequest]:
    """Random words; an optional prefix shared by all, then `input_len` tokens of its own."""
    input_lens = draw_lengths(spec.input_len, spec.range_ratio, num_prompts, rng)
    output_lens = draw_lengths(spec.output_len, spec.range_ratio, num_prompts, rng)
    prefix = synthesize_text(spec.prefix_len, rng, counter)[0] if spec.prefix_len else None
    return [
        _prefixed_sample(prefix, int(n_in), int(n_out), rng, counter)
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def sample_prefix_repetition(
    spec: PrefixRepetitionSpec, num_prompts: int, rng: np.random.Generator, counter: TokenCounter
) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes, each followed by distinct suffixes, in shuffled order."""
    prefixes = [synthesize_text(spec.prefix_len, rng, counter)[0] for _ in range(spec.num_prefixes)]
    samples = [
        _prefixed_sample(
            prefixes[i % spec.num_prefixes], spec.suffix_len, spec.output_len, rng, counter
        )
        for i in range(num_prompts)
    ]
    return [samples[i] for i in rng.permutation(num_prompts)]


def sample_mixed(
    spec: MixedSpec, num_prompts: int, rng: np.random.Generator, counter: TokenCounter
) -> list[SampleRequest]:
    """Short prompts with round(long_fraction * num_prompts) long ones at random positions."""
    num_long = round(spec.long_fraction * num_prompts)
    is_long = np.zeros(num_prompts, dtype=bool)
    is_long[rng.choice(num_prompts, size=num_long, replace=False)] = True
    short_lens = draw_lengths(spec.short_len, spec.range_ratio, num_prompts, rng)
    long_lens = draw_lengths(spec.long_len, spec.range_ratio, num_prompts, rng)
    output_lens = draw_lengths(spec.output_len, spec.range_ratio, num_prompts, rng)
    input_lens = np.where(is_long, long_lens, short_lens)
    return [
        _prefixed_sample(None, int(n_in), int(n_out), rng, counter)
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def draw_lengths(
    length: int, range_ratio: float, count: int, rng: np.random.Generator
) -> np.ndarray:
    """Integers uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count)


def _prefixed_sample(
    prefix: str | None,
    body_len: int,
    output_len: int,
    rng: np.random.Generator,
    counter: TokenCounter,
) -> SampleRequest:
    body, count = synthesize_text(body_len, rng, counter)
    if prefix is None:
        return SampleRequest(body, count, output_len)
    prompt = f"{prefix} {body}"
    return SampleRequest(prompt, counter.count(prompt), output_len)
