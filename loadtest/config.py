"""The configuration of one `tandem bench` invocation: one frozen dataclass per component,
composed into `BenchConfig`. Facts found while running (the model id) never go back in here."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from loadtest.errors import BenchError

CHAT_SUFFIX = "/chat/completions"
METRICS = ("ttft", "tpot", "itl", "e2el")


class Backend(enum.Enum):
    """vLLM's `--backend` names for the request formats tandem sends."""

    OPENAI = "openai"  # /v1/completions
    VLLM = "vllm"  # the same requests as openai
    OPENAI_CHAT = "openai-chat"  # /v1/chat/completions


@dataclass(frozen=True)
class TargetConfig:
    base_url: str
    endpoint: str
    model: str | None  # None: the first id the server lists at /v1/models
    api_key: str | None
    request_timeout_s: float
    backend: Backend | None = None  # None: chat or not as the endpoint says
    served_model_name: str | None = None  # the model field of requests, when not `model`
    headers: tuple[tuple[str, str], ...] = ()  # sent with every request, after Authorization

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(
                f"--base-url must start with http:// or https://, got {self.base_url!r}"
            )
        if not self.endpoint.startswith("/"):
            raise BenchError(f"--endpoint must start with '/', got {self.endpoint!r}")
        base = self.base_url.rstrip("/")
        if base.endswith("/v1") and self.endpoint.startswith("/v1/"):
            base = base.removesuffix("/v1")  # an OpenAI SDK's base URL: the endpoint has /v1
        object.__setattr__(self, "base_url", base)
        _require(self.request_timeout_s > 0, "--request-timeout must be > 0")
        if self.backend is not None and (self.backend is Backend.OPENAI_CHAT) != self.is_chat:
            raise BenchError(_backend_mismatch(self.backend, self.endpoint))

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith(CHAT_SUFFIX)

    @property
    def backend_name(self) -> str:
        """vLLM's `endpoint_type`: the --backend given, else the one the endpoint implies."""
        if self.backend is not None:
            return self.backend.value
        return (Backend.OPENAI_CHAT if self.is_chat else Backend.OPENAI).value


def _backend_mismatch(backend: Backend, endpoint: str) -> str:
    if backend is Backend.OPENAI_CHAT:
        return (
            f"--backend openai-chat sends chat requests, but --endpoint {endpoint} is not "
            f"a chat endpoint (use --endpoint /v1{CHAT_SUFFIX})"
        )
    return (
        f"--backend {backend.value} sends completions requests, but --endpoint {endpoint} "
        "is a chat endpoint (use --backend openai-chat)"
    )


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling fields sent with every request; None leaves a field to the server's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    extra_body: Mapping[str, object] | None = None  # merged into every request body last


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests per second; inf sends everything at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is a Poisson process
    max_concurrency: int | None = None
    num_warmups: int = 0
    max_duration_s: float | None = None  # stop sending and abort what is in flight after this
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.request_rate > 0, "--request-rate must be > 0")
        _require(self.burstiness > 0, "--burstiness must be > 0")
        concurrency_ok = self.max_concurrency is None or self.max_concurrency > 0
        _require(concurrency_ok, "--max-concurrency must be > 0")
        _require(self.num_warmups >= 0, "--num-warmups must be >= 0")
        duration_ok = self.max_duration_s is None or self.max_duration_s > 0
        _require(duration_ok, "--max-duration must be > 0")
        _require(self.seed >= 0, "--seed must be >= 0")  # (numpy's generators take no other)


# Tokens one prompt or output of a made-up dataset may have: past any model's context, and
# still within memory (a prompt is held as a list of ids; a typo of 10^8 took 19 GB).
MAX_DATASET_TOKENS = 1 << 20


def _lengths_bounded(*lengths: float) -> None:
    _require(
        all(n <= MAX_DATASET_TOKENS for n in lengths),
        f"dataset lengths must be at most {MAX_DATASET_TOKENS:,} tokens",
    )


@dataclass(frozen=True)
class RandomSpec:
    name: ClassVar[str] = "random"
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    prefix_len: int = 0  # tokens of one prefix shared by every prompt

    def __post_init__(self) -> None:
        _require(self.input_len > 0 and self.output_len > 0, "random lengths must be > 0")
        _require(0 <= self.range_ratio < 1, "--random-range-ratio must be in [0, 1)")
        _require(self.prefix_len >= 0, "--random-prefix-len must be >= 0")
        longest = self.input_len * (1 + self.range_ratio)
        _lengths_bounded(longest + self.prefix_len, self.output_len * (1 + self.range_ratio))


@dataclass(frozen=True)
class ShareGPTSpec:
    name: ClassVar[str] = "sharegpt"
    path: Path
    output_len: int | None = None  # None: the length of the recorded reply
    shuffle: bool = True  # False: conversations in file order (vLLM's --disable-shuffle)

    def __post_init__(self) -> None:
        fixed = self.output_len
        _require(fixed is None or fixed > 0, "--sharegpt-output-len must be > 0")


@dataclass(frozen=True)
class PrefixRepetitionSpec:
    name: ClassVar[str] = "prefix_repetition"
    num_prefixes: int = 10
    prefix_len: int = 256
    suffix_len: int = 256
    output_len: int = 128

    def __post_init__(self) -> None:
        lens = (self.num_prefixes, self.prefix_len, self.suffix_len, self.output_len)
        _require(min(lens) > 0, "prefix-repetition counts and lengths must be > 0")
        _lengths_bounded(self.prefix_len + self.suffix_len, self.output_len)


@dataclass(frozen=True)
class MixedSpec:
    """Short prompts with a fraction of long ones among them."""

    name: ClassVar[str] = "mixed"

    short_len: int = 256
    long_len: int = 4096
    long_fraction: float = 0.1
    output_len: int = 128
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        _require(
            min(self.short_len, self.long_len, self.output_len) > 0, "mixed lengths must be > 0"
        )
        _require(0 <= self.long_fraction <= 1, "--mixed-long-fraction must be in [0, 1]")
        _lengths_bounded(self.short_len, self.long_len, self.output_len)
        _require(0 <= self.range_ratio < 1, "--random-range-ratio must be in [0, 1)")


DatasetSpec = RandomSpec | ShareGPTSpec | PrefixRepetitionSpec | MixedSpec


@dataclass(frozen=True)
class DatasetConfig:
    spec: DatasetSpec
    num_prompts: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.num_prompts > 0, "--num-prompts must be > 0")
        _require(self.seed >= 0, "--seed must be >= 0")


@dataclass(frozen=True)
class GoodputSLO:
    """Service-level objectives in milliseconds; a request is good when it meets every one set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def limits_ms(self) -> dict[str, float]:
        """The objectives set, by metric name ("ttft", "tpot", "e2el")."""
        limits = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2el_ms}
        return {name: limit for name, limit in limits.items() if limit is not None}


@dataclass(frozen=True)
class ResultFile:
    """Where --save-result writes: `filename` (a path of its own when `directory` is None), else
    vLLM's default name, inside `directory`, else the working directory."""

    directory: Path | None = None
    filename: str | None = None


@dataclass(frozen=True)
class OutputConfig:
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    percentile_metrics: tuple[str, ...] = METRICS  # the console shows these; JSON has all
    goodput: GoodputSLO | None = None
    label: str | None = None
    save_result: ResultFile | None = None  # None: nothing is saved
    metadata: tuple[tuple[str, str], ...] = ()  # extra top-level keys of the saved record
    plot_dir: Path | None = None
    show_progress: bool = True


class SweepParameter(enum.Enum):
    REQUEST_RATE = "request-rate"
    MAX_CONCURRENCY = "max-concurrency"


@dataclass(frozen=True)
class SweepSpec:
    parameter: SweepParameter
    values: tuple[float, ...]  # ascending


@dataclass(frozen=True)
class BenchConfig:
    target: TargetConfig
    dataset: DatasetConfig
    sampling: SamplingConfig
    load: LoadConfig
    output: OutputConfig
    tokenizer: Path | None = None  # None: count tokens with the server's /tokenize
    trust_remote_code: bool = False  # passed to the local tokenizer's loader
    sweep: SweepSpec | None = None  # None: a single run at `load`


def parse_goodput(items: list[str]) -> GoodputSLO:
    """['ttft:500', 'tpot:50'] -> GoodputSLO(ttft_ms=500, tpot_ms=50)."""
    values: dict[str, float] = {}
    for item in items:
        key, sep, number = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise BenchError(
                f"--goodput {item!r}: expected KEY:MS with KEY one of ttft, tpot, e2el"
            )
        values[f"{key}_ms"] = _positive_float(number, f"--goodput {item!r}")
    return GoodputSLO(**values)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0); 99 is always included, as vLLM's p99 keys are expected."""
    values = {_positive_float(p, f"--metric-percentiles {text!r}") for p in text.split(",")}
    if any(p > 100 for p in values):
        raise BenchError(f"--metric-percentiles {text!r}: percentiles must be in (0, 100]")
    return tuple(sorted(values | {99.0}))


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """'ttft,itl' -> ('ttft', 'itl'), in the order given."""
    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        if name not in METRICS:
            raise BenchError(
                f"--percentile-metrics {text!r}: {name!r} is not one tandem measures "
                f"({', '.join(METRICS)})"
            )
    return tuple(dict.fromkeys(names))


def parse_pairs(items: list[str], flag: str) -> tuple[tuple[str, str], ...]:
    """['k=v', ...] -> (('k', 'v'), ...), as vLLM's --header and --metadata take them."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BenchError(f"{flag} {item!r}: expected KEY=VALUE")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def _positive_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise BenchError(f"{what}: {text.strip()!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise BenchError(f"{what}: {text.strip()!r} must be a positive number")
    return value


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise BenchError(message)
