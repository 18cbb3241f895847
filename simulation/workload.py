"""What a simulation serves: requests with arrival times, prompt token ids and output lengths.

Three sources, all ending in a list of `SimRequest`:
- `tandem bench`'s own datasets, with the model's tokenizer: the very prompts a real
  `tandem bench` run with the same options sends (used to check the simulator against real runs);
- the same dataset options without a tokenizer (`synthetic_requests`): lengths drawn as the
  datasets draw them, prefixes shared as they share them, token ids made up;
- a trace file: one JSON object per line with `arrival` (seconds), `prompt_len`, `output_len`,
  and optionally `prefix_id` and `prefix_len` (requests with the same prefix id share that many
  leading tokens; a prefix is as long on every row that names it, and no longer than its
  prompt).

Made-up prompts are `TokenIds`: a few integers that stand for the whole list, so an hour of
8,000-token prompts fits in memory. They support what the scheduler, block manager and router
do with token ids: len, indexing, slicing, append.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import NamedTuple, overload

import numpy as np

from loadtest.arrivals import send_offsets
from loadtest.config import (
    DatasetConfig,
    DatasetSpec,
    LoadConfig,
    MixedSpec,
    PrefixRepetitionSpec,
    RandomSpec,
)
from loadtest.datasets import draw_lengths
from loadtest.sample import SampleRequest

MAX_ARRIVAL_S = 30 * 24 * 3600.0  # a month: the stats poll ticks every simulated second
MAX_TRACE_TOKENS = 1 << 30


class SimulationError(ValueError):
    """A workload, deployment or cost file the simulator cannot use (a clear CLI message)."""


class TokenIds(Sequence[int]):
    """`prefix_len` ids from `prefix_base` on, then ids from `own_base` on; appending counts.

    Token i is `prefix_base + i` inside the prefix and `own_base + i` after it, so two prompts
    share exactly their common prefix (bases are far apart), and every generated token is new.
    """

    __slots__ = ("_len", "own_base", "prefix_base", "prefix_len")

    def __init__(self, prefix_base: int, prefix_len: int, own_base: int, length: int) -> None:
        self.prefix_base, self.prefix_len, self.own_base = prefix_base, prefix_len, own_base
        self._len = length

    def __len__(self) -> int:
        return self._len

    def _at(self, i: int) -> int:
        return self.prefix_base + i if i < self.prefix_len else self.own_base + i

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return [self._at(i) for i in range(start, stop, step)]
            # (A block's slice, once per block hashed: the simulator's most frequent call.)
            if start >= self.prefix_len:
                return list(range(self.own_base + start, self.own_base + stop))
            if stop <= self.prefix_len:
                return list(range(self.prefix_base + start, self.prefix_base + stop))
            split = self.prefix_len
            return [*range(self.prefix_base + start, self.prefix_base + split)] + [
                *range(self.own_base + split, self.own_base + stop)
            ]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("token index out of range")
        return self._at(index)

    def __iter__(self) -> Iterator[int]:
        return iter(self[:])

    def append(self, token_id: int) -> None:
        """Adds the next made-up token (`token_id` is ignored: only the count matters)."""
        self._len += 1

    def extend(self, token_ids: Iterable[int]) -> None:
        """Adds one made-up token per id given."""
        self._len += len(token_ids) if isinstance(token_ids, Sized) else sum(1 for _ in token_ids)

    def copy(self) -> TokenIds:
        return TokenIds(self.prefix_base, self.prefix_len, self.own_base, self._len)


class SimRequest(NamedTuple):
    arrival: float  # seconds after the start when the client means to send it
    prompt_ids: Sequence[int]
    output_len: int


class IdSpace:
    """Hands out disjoint ranges of made-up token ids."""

    def __init__(self) -> None:
        self._next = 1 << 20  # above any real vocabulary

    def take(self, count: int) -> int:
        base, self._next = self._next, self._next + count + 1
        return base


def with_arrivals(
    prompts: Sequence[tuple[Sequence[int], int]], load: LoadConfig
) -> list[SimRequest]:
    """Arrival times as `tandem bench` draws them (rate, burstiness, seed)."""
    offsets = send_offsets(len(prompts), load.request_rate, load.burstiness, load.seed)
    if len(offsets) and offsets[-1] > MAX_ARRIVAL_S:
        raise SimulationError(
            f"at {load.request_rate:g} req/s the last request arrives after {offsets[-1]:.3g} s; "
            f"a simulation spans at most {MAX_ARRIVAL_S:.0f} s"
        )
    return [
        SimRequest(float(at), ids, int(n_out))
        for at, (ids, n_out) in zip(offsets, prompts, strict=True)
    ]


def from_samples(
    samples: Sequence[SampleRequest], encode: Callable[[str], list[int]], load: LoadConfig
) -> list[SimRequest]:
    """A real `tandem bench` dataset, tokenized as the server tokenizes it."""
    return with_arrivals([(encode(s.prompt), s.expected_output_len) for s in samples], load)


def synthetic_requests(dataset: DatasetConfig, load: LoadConfig) -> list[SimRequest]:
    """`tandem bench`'s dataset options without a tokenizer: the same length distributions
    and prefix sharing, made-up token ids."""
    rng = np.random.default_rng(dataset.seed)
    ids = IdSpace()
    prompts = _synthetic_prompts(dataset.spec, dataset.num_prompts, rng, ids)
    return with_arrivals(prompts, load)


def _synthetic_prompts(
    spec: DatasetSpec, count: int, rng: np.random.Generator, ids: IdSpace
) -> list[tuple[TokenIds, int]]:
    if isinstance(spec, RandomSpec):
        input_lens = draw_lengths(spec.input_len, spec.range_ratio, count, rng)
        output_lens = draw_lengths(spec.output_len, spec.range_ratio, count, rng)
        prefix = ids.take(spec.prefix_len)
        return [
            (_prompt(ids, prefix, spec.prefix_len, spec.prefix_len + int(n)), int(m))
            for n, m in zip(input_lens, output_lens, strict=True)
        ]
    if isinstance(spec, PrefixRepetitionSpec):
        prefixes = [ids.take(spec.prefix_len) for _ in range(spec.num_prefixes)]
        length = spec.prefix_len + spec.suffix_len
        prompts = [
            (
                _prompt(ids, prefixes[i % spec.num_prefixes], spec.prefix_len, length),
                spec.output_len,
            )
            for i in range(count)
        ]
        return [prompts[i] for i in rng.permutation(count)]
    if isinstance(spec, MixedSpec):
        is_long = np.zeros(count, dtype=bool)
        is_long[rng.choice(count, size=round(spec.long_fraction * count), replace=False)] = True
        short = draw_lengths(spec.short_len, spec.range_ratio, count, rng)
        long = draw_lengths(spec.long_len, spec.range_ratio, count, rng)
        outputs = draw_lengths(spec.output_len, spec.range_ratio, count, rng)
        lengths = np.where(is_long, long, short)
        return [(_prompt(ids, 0, 0, int(n)), int(m)) for n, m in zip(lengths, outputs, strict=True)]
    raise SimulationError(
        f"the {spec.name} dataset needs its prompts: simulate it with --tokenizer, or as a trace"
    )


def _prompt(ids: IdSpace, prefix_base: int, prefix_len: int, length: int) -> TokenIds:
    return TokenIds(prefix_base, prefix_len, ids.take(length) - prefix_len, length)


def load_trace(path: Path) -> list[SimRequest]:
    """A JSON-lines trace (see the module docstring), sorted by arrival."""
    ids = IdSpace()
    prefixes: dict[object, tuple[int, int, int]] = {}
    requests: list[SimRequest] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise SimulationError(f"cannot read trace {path}: {err}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival, n_in, n_out = (
                float(row["arrival"]),
                int(row["prompt_len"]),
                int(row["output_len"]),
            )
            prefix_id, prefix_len = row.get("prefix_id"), int(row.get("prefix_len", 0))
            hash(prefix_id)  # (a list or an object cannot name a prefix)
        except (ValueError, KeyError, TypeError, OverflowError, AttributeError) as err:
            raise SimulationError(f"{path}:{number}: not a trace row ({err!r})") from None
        if not (math.isfinite(arrival) and arrival >= 0 and n_in > 0 and n_out > 0):
            raise SimulationError(f"{path}:{number}: arrival >= 0 and lengths > 0, please")
        if arrival > MAX_ARRIVAL_S or max(n_in, n_out, prefix_len) > MAX_TRACE_TOKENS:
            raise SimulationError(
                f"{path}:{number}: arrivals up to {MAX_ARRIVAL_S:.0f} s and lengths up to "
                f"{MAX_TRACE_TOKENS} tokens, please"
            )
        problem = _prefix_problem(prefix_id, prefix_len, n_in, prefixes)
        if problem is not None:
            raise SimulationError(f"{path}:{number}: {problem}")
        if prefix_id is None:
            prompt = _prompt(ids, 0, 0, n_in)
        else:
            base, _, _ = prefixes.setdefault(prefix_id, (ids.take(prefix_len), prefix_len, number))
            prompt = _prompt(ids, base, prefix_len, n_in)
        requests.append(SimRequest(arrival, prompt, n_out))
    if not requests:
        raise SimulationError(f"trace {path} has no requests")
    return sorted(requests, key=lambda r: r.arrival)


def _prefix_problem(
    prefix_id: object, prefix_len: int, n_in: int, prefixes: dict[object, tuple[int, int, int]]
) -> str | None:
    """What is inconsistent in a trace row's prefix, or None. `prefixes`: each prefix id seen
    so far -> (its first token id, its length, the line that named it first)."""
    if prefix_id is None:
        return "prefix_len without a prefix_id" if prefix_len else None
    if not 0 < prefix_len <= n_in:
        return f"prefix_len must be 1 to prompt_len ({n_in}), not {prefix_len}"
    _, known_len, line = prefixes.get(prefix_id, (0, prefix_len, 0))
    if known_len != prefix_len:
        return f"prefix {prefix_id!r} is {prefix_len} tokens here but {known_len} on line {line}"
    return None


def rate_profile(
    rate: Callable[[float], float],
    duration_s: float,
    prompt: Callable[[int, float], tuple[TokenIds, int]],
    seed: int = 0,
) -> list[SimRequest]:
    """A Poisson process with a time-varying rate (thinning), for step and sinusoid loads;
    `prompt(index, arrival)` makes each request's prompt and output length."""
    rng = np.random.default_rng(seed)
    peak = max(rate(t) for t in np.linspace(0.0, duration_s, 1001))
    if peak <= 0:
        raise SimulationError("the request rate is never above 0")
    requests: list[SimRequest] = []
    t = 0.0
    for index in itertools.count():
        t += float(rng.exponential(1.0 / peak))
        if t >= duration_s:
            break
        if rng.random() < rate(t) / peak:
            ids, n_out = prompt(index, t)
            requests.append(SimRequest(t, ids, n_out))
    return requests
