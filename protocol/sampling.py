"""How one request picks its tokens and why it stopped: the sampling half of every request."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple


class SamplingError(ValueError):
    """Sampling parameters that make no sense; the message names the parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


class TokenLogprobs(NamedTuple):
    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # the most likely tokens, best first


class PromptLogprob(NamedTuple):
    """A prompt token's logprob given the tokens before it, its rank there (1: the most
    likely token), and the most likely tokens there, best first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 256
STRUCTURE_KINDS = ("json_object", "json_schema", "regex")  # engine/structured.py
# A response format is compiled on the engine's thread, in a time that grows with its size and
# faster with its nesting (on this project's 2-core VM: 100 KB of schema ~1 s, 64 nested
# objects 0.1 s, 128 of them 0.75 s): past these a request is refused rather than stall every
# sequence of its worker.
MAX_STRUCTURE_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 64  # nested JSON objects and arrays in a schema
MAX_LOGIT_BIAS = 1024  # tokens one request may bias (each is a write into its logits per step)
# distinct stop token ids one request may name: each step tests the sampled token against them,
# and while under min_tokens builds the set of tokens to block from them
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int | None = None  # None: every token stays a candidate
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or the output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # also return this many most likely alternatives per token
    # The prompt's tokens' logprobs too (each given the tokens before it), with this many
    # alternatives each; computing them needs every prompt position, so no prefix cache hit.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # (token id, added to its logit before sampling), as OpenAI's logit_bias; sorted by id
    logit_bias: tuple[tuple[int, float], ...] = ()
    # What the output must be (engine/structured.py): ("json_object", ""), ("json_schema",
    # the schema as JSON text) or ("regex", a pattern); None: anything
    structure: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        _check(self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]")
        # (NaN fails every comparison; infinity would turn the logits into NaN)
        _check(0 <= self.temperature < math.inf, "temperature", "must be a finite number >= 0")
        _check(self.top_k is None or self.top_k >= 1, "top_k", "must be positive (None: off)")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(
            0 < self.repetition_penalty < math.inf, "repetition_penalty", "must be finite and > 0"
        )
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _check(all(self.stop), "stop", "must not contain empty strings")
        for text in self.stop:  # (no generated text holds one: it could never match)
            _check_unicode("stop", text)
        # (each is searched for in the new text of every token, on the serving event loop)
        _check(
            len(self.stop) <= MAX_STOP_STRINGS, "stop", f"takes at most {MAX_STOP_STRINGS} strings"
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"takes at most {MAX_STOP_TOKEN_IDS} distinct ids",
        )
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            "must be in [0, 20]",
        )
        _check(self.seed is None or 0 <= self.seed < 2**64, "seed", "must be in [0, 2**64)")
        _check(
            all(-100 <= b <= 100 for _, b in self.logit_bias),  # (NaN fails too)
            "logit_bias",
            "values must be in [-100, 100]",
        )
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"takes at most {MAX_LOGIT_BIAS} tokens",
        )
        if self.structure is not None:
            object.__setattr__(self, "structure", tuple(self.structure))
            _check(
                len(self.structure) == 2 and self.structure[0] in STRUCTURE_KINDS,
                "response_format",
                f"must be one of {', '.join(STRUCTURE_KINDS)}",
            )
            _check_structure(*self.structure)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_TEMPERATURE are greedy too (as in vLLM): dividing logits
        by them overflows float32, and greedy is what they tend to."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change the logits before sampling."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    def stop_ids(self, eos_ids: Collection[int]) -> frozenset[int]:
        """The one stop rule for token ids: the request's stop tokens, plus EOS unless ignored."""
        if self.ignore_eos:
            return frozenset(self.stop_token_ids)
        return frozenset(self.stop_token_ids).union(eos_ids)

    def stops_at(self, token_id: int, eos_ids: Collection[int]) -> bool:
        """`token_id in self.stop_ids(eos_ids)`, without building the set (it runs for every
        sequence at every step)."""
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in eos_ids)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises SamplingError when a token id or a count points past the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        _check(not bad, "stop_token_ids", f"must be in [0, {vocab_size}); got {bad[:3]}")
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
        _check(not bad, "logit_bias", f"token ids must be in [0, {vocab_size}); got {bad[:3]}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise SamplingError(name, message)


def _check_unicode(name: str, text: str) -> None:
    """Valid Unicode: a lone surrogate (a `\\ud800` escape, which JSON allows) is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SamplingError(
            name, f"is not valid Unicode: a lone surrogate at character {err.start}"
        ) from None


def _check_structure(kind: str, text: str) -> None:
    """A response format's text: Unicode (a lone surrogate, as JSON escapes allow, is not),
    and small and shallow enough to compile in well under a second."""
    _check_unicode("response_format", text)
    _check(
        len(text) <= MAX_STRUCTURE_CHARS,
        "response_format",
        f"may be at most {MAX_STRUCTURE_CHARS} characters long",
    )
    if kind != "json_schema":
        return
    try:
        schema = json.loads(text)
    except RecursionError:
        schema = None
    except ValueError:
        return  # not JSON: the compiler says so, as for any other schema it refuses
    _check(
        schema is not None and _depth(schema) <= MAX_SCHEMA_DEPTH,
        "response_format",
        f"nests its schema more than {MAX_SCHEMA_DEPTH} deep",
    )


def _depth(value: object) -> int:
    """How deep JSON objects and arrays nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest
