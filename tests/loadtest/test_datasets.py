"""Workloads: lengths measured with the tokenizer, shared prefixes shared, seeds reproducible, and
malformed ShareGPT files rejected with a message naming the problem."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loadtest.config import DatasetConfig, MixedSpec, PrefixRepetitionSpec, RandomSpec, ShareGPTSpec
from loadtest.datasets import sample_requests
from loadtest.errors import BenchError
from loadtest.prompts import synthesize_text
from tests.support.bench import WhitespaceCounter


class TwoTokensPerWord:
    def count(self, text: str) -> int:
        return 2 * len(text.split())


def sample(spec, num_prompts: int = 20, seed: int = 0, counter=None):
    counter = counter or WhitespaceCounter()
    return sample_requests(DatasetConfig(spec, num_prompts=num_prompts, seed=seed), counter)


def test_random_lengths_within_the_range_and_measured() -> None:
    samples = sample(RandomSpec(input_len=40, output_len=10, range_ratio=0.5), num_prompts=200)
    assert all(20 <= s.prompt_len <= 60 for s in samples)
    assert all(5 <= s.expected_output_len <= 15 for s in samples)
    assert all(s.prompt_len == len(s.prompt.split()) for s in samples)
    assert len({s.prompt_len for s in samples}) > 10
    assert len({s.prompt for s in samples}) == 200


def test_random_without_range_is_exact() -> None:
    samples = sample(RandomSpec(input_len=32, output_len=8))
    assert {(s.prompt_len, s.expected_output_len) for s in samples} == {(32, 8)}


def test_random_prefix_is_shared_and_counted() -> None:
    samples = sample(RandomSpec(input_len=10, output_len=4, prefix_len=16))
    prefixes = {" ".join(s.prompt.split()[:16]) for s in samples}
    assert len(prefixes) == 1
    assert {s.prompt_len for s in samples} == {26}


def test_same_seed_same_prompts() -> None:
    spec = RandomSpec(input_len=12, output_len=4, range_ratio=0.3)
    assert sample(spec, seed=5) == sample(spec, seed=5)
    assert sample(spec, seed=5) != sample(spec, seed=6)


def test_prefix_repetition_uses_each_prefix_equally() -> None:
    spec = PrefixRepetitionSpec(num_prefixes=3, prefix_len=8, suffix_len=5, output_len=4)
    samples = sample(spec, num_prompts=12)
    uses = Counter(" ".join(s.prompt.split()[:8]) for s in samples)
    assert sorted(uses.values()) == [4, 4, 4]
    assert len({s.prompt for s in samples}) == 12
    assert {s.prompt_len for s in samples} == {13}


def test_mixed_has_the_requested_share_of_long_prompts() -> None:
    spec = MixedSpec(short_len=10, long_len=100, long_fraction=0.25, output_len=4)
    lens = [s.prompt_len for s in sample(spec, num_prompts=40)]
    assert Counter(lens) == {10: 30, 100: 10}


def test_synthesized_text_fits_a_tokenizer_with_several_tokens_per_word() -> None:
    rng = np.random.default_rng(0)
    text, count = synthesize_text(50, rng, TwoTokensPerWord())
    assert count == TwoTokensPerWord().count(text) == 50


def test_synthesized_count_is_the_measured_one_even_when_inexact() -> None:
    text, count = synthesize_text(51, np.random.default_rng(0), TwoTokensPerWord())
    assert count == TwoTokensPerWord().count(text) and abs(count - 51) == 1


def conversation(prompt_words: int, reply_words: int) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": "q " * prompt_words},
            {"from": "gpt", "value": "a " * reply_words},
        ]
    }


def write(path: Path, content: object) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_sharegpt_takes_first_two_turns_and_filters(tmp_path: Path) -> None:
    entries = [
        conversation(10, 20),
        conversation(2, 20),
        conversation(1100, 10),
        conversation(8, 6),
    ]
    entries.append({"conversations": [{"from": "human", "value": "alone"}]})
    path = write(tmp_path / "sg.json", entries)
    samples = sample(ShareGPTSpec(path), num_prompts=10)
    assert sorted((s.prompt_len, s.expected_output_len) for s in samples) == [(8, 6), (10, 20)]


def test_sharegpt_fixed_output_len_and_num_prompts(tmp_path: Path) -> None:
    path = write(tmp_path / "sg.json", [conversation(10 + i, 20) for i in range(10)])
    samples = sample(ShareGPTSpec(path, output_len=7), num_prompts=4)
    assert len(samples) == 4
    assert {s.expected_output_len for s in samples} == {7}


def test_a_fixed_output_len_skips_only_the_minimum_output_check(tmp_path: Path) -> None:
    """As vLLM's is_valid_sequence: the prompt (<= 1,024) and total (<= 2,048) limits still
    hold with a fixed output length; they were skipped, and 3,000-token prompts came through."""
    entries = [conversation(3000, 10), conversation(1000, 3), conversation(10, 3)]
    path = write(tmp_path / "sg.json", entries)
    samples = sample(ShareGPTSpec(path, output_len=1500), num_prompts=10)
    assert [(s.prompt_len, s.expected_output_len) for s in samples] == [(10, 1500)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "{not json",
            "is not valid JSON: Expecting property name enclosed in double quotes at line 1 "
            "column 2",
        ),
        ({"conversations": []}, "expected a JSON list of conversations, got a JSON object"),
        ([{"conversations": "hello"}], "entry 0 has no 'conversations' list"),
        (
            [conversation(5, 5), {"conversations": [{"value": 3}, {"value": "x"}]}],
            "entry 1 has a turn without a string 'value'",
        ),
        ([{"conversations": [{"value": "only one"}]}], "holds no conversation with two turns"),
        ([conversation(2, 2)], "no conversation fits"),
    ],
)
def test_malformed_sharegpt_files(tmp_path: Path, content: object, message: str) -> None:
    path = write(tmp_path / "bad.json", content)
    with pytest.raises(BenchError, match="dataset .*bad.json") as err:
        sample(ShareGPTSpec(path))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_sharegpt_file(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="does not exist"):
        sample(ShareGPTSpec(tmp_path / "none.json"))


def test_sharegpt_in_file_order_without_shuffle(tmp_path: Path) -> None:
    path = write(tmp_path / "sg.json", [conversation(10 + i, 20) for i in range(6)])
    samples = sample(ShareGPTSpec(path, shuffle=False), num_prompts=4)
    assert [s.prompt_len for s in samples] == [10, 11, 12, 13]


@pytest.mark.parametrize("length", [0, -5])
def test_a_sharegpt_output_len_must_be_positive(tmp_path: Path, length: int) -> None:
    """It was sent as max_tokens, and every request failed with "no generated text"."""
    with pytest.raises(BenchError, match="--sharegpt-output-len must be > 0"):
        ShareGPTSpec(tmp_path / "sg.json", output_len=length)
