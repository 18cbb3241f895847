"""ShareGPT-format datasets: a JSON list of {"conversations": [{"from", "value"}, ...]}. The first
turn is the prompt and the second the reply whose length becomes the output length, filtered the
way vLLM filters them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loadtest.config import ShareGPTSpec
from loadtest.errors import BenchError
from loadtest.sample import SampleRequest
from loadtest.token_count import TokenCounter

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


def load_conversations(path: Path) -> list[tuple[str, str]]:
    """(prompt, reply) pairs from every conversation with at least two turns."""
    data = _read_json(path)
    if not isinstance(data, list):
        raise BenchError(
            f"dataset {path}: expected a JSON list of conversations, got a {_kind(data)}"
        )
    pairs = []
    for index, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise BenchError(f"dataset {path}: entry {index} has no 'conversations' list")
        if len(turns) >= 2:
            pairs.append((_turn_text(turns[0], path, index), _turn_text(turns[1], path, index)))
    if not pairs:
        raise BenchError(f"dataset {path} holds no conversation with two turns")
    return pairs


def sample_sharegpt(
    spec: ShareGPTSpec, num_prompts: int, rng: np.random.Generator, counter: TokenCounter
) -> list[SampleRequest]:
    """Up to `num_prompts` conversations in seeded random order (file order without shuffle),
    skipping ones too short or long."""
    pairs = load_conversations(spec.path)
    samples: list[SampleRequest] = []
    order = rng.permutation(len(pairs)) if spec.shuffle else range(len(pairs))
    for index in order:
        if len(samples) == num_prompts:
            break
        prompt, reply = pairs[index]
        prompt_len = counter.count(prompt)
        output_len = counter.count(reply) if spec.output_len is None else spec.output_len
        if _fits(prompt_len, output_len, fixed_output=spec.output_len is not None):
            samples.append(SampleRequest(prompt, prompt_len, output_len))
    if not samples:
        raise BenchError(
            f"dataset {spec.path}: no conversation fits ({MIN_LEN} to {MAX_PROMPT_LEN} prompt "
            f"tokens, at most {MAX_TOTAL_LEN} with the reply)"
        )
    return samples


def _fits(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's filter; a fixed output length skips only its minimum (the prompt and total
    limits still hold, as in vLLM's is_valid_sequence)."""
    if prompt_len < MIN_LEN or (output_len < MIN_LEN and not fixed_output):
        return False
    return prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"dataset {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise BenchError(
            f"dataset {path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise BenchError(f"cannot read dataset {path}: {err}") from None


def _turn_text(turn: object, path: Path, index: int) -> str:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise BenchError(f"dataset {path}: entry {index} has a turn without a string 'value'")
    return turn["value"]


def _kind(value: object) -> str:
    return "JSON object" if isinstance(value, dict) else type(value).__name__
