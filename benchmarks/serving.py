"""Served throughput: tandem over HTTP against the same engine driven in-process, same requests.

    python benchmarks/serving.py [--models smollm2 overhead] [--concurrency 16 64] [--rounds 3] \
        [--num-prompts N] [--output-len 128] [--targets inprocess colocated 1p1d] \
        [--peer NAME=URL ...] [--engine-threads N] [--json results/serving.json]
    python benchmarks/serving.py --quick   # 1 round, concurrency 16, overhead model: a few minutes

Targets, measured in interleaved rounds (A B C A B C ...) so a slow spell of the machine lands on
every target rather than on one:

- inprocess: `AsyncEngine` over `LLMEngine` in this process, driven by asyncio (the model
  loaded on one thread, every core on the engine thread, as a served worker does);
- stepped (not a default): `LLMEngine.step()` in a plain loop, the same closed loop of streams
  with no asyncio, detokenizing or HTTP: the ceiling (on a GPU the in-process target's client
  shares the engine's GIL at 2-3 ms a step and falls below the served one);
- colocated: `tandem serve --mode colocated --prefill-workers 0 --decode-workers 1` (one worker,
  every core);
- 1p1d: `tandem serve --mode disaggregated --prefill-workers 1 --decode-workers 1` (the decode
  worker on every core, the prefill worker on cores / 2: `coordinator/builder.py`'s split);
- 1p1d-shared (not a default): 1p1d with every worker on every core; colocated-tp2 (not a
  default): one colocated worker of two tensor-parallel ranks; colocated-interval4 (not a
  default): colocated with `--stream-interval 4`;
- a peer given by `--peer NAME=URL`: any OpenAI-compatible server already running on this host
  (a vLLM CPU server, say), serving the one model given with `--models`. It runs all along; while
  other targets run its process group is stopped (SIGSTOP; `--no-pause-peers` leaves it idling
  beside them, as tandem's own servers are not), since an idle server still takes CPU.

Each server is started for its round by `ServeProcess`, warmed up, measured at every concurrency
and stopped before the next target starts; the in-process engine is loaded and dropped the same
way. Load: `--concurrency` client coroutines, each streaming one request after another from a
shared list of `--num-prompts` prompts (~100 tokens of words, `--output-len` tokens out; greedy
unless `--temperature` (and `--top-p`) say otherwise; EOS ignored; prefix caching off so every
round prefills). The HTTP clients are `tandem bench`'s
(`loadtest.client.send_request`); the in-process client times the engine's outputs the same way:
TTFT is send to the first output carrying text, ITL every gap between outputs carrying text,
output tok/s the tokens of the round over its wall time.

Models: SmolLM2-135M-Instruct, and an "overhead model" made here once (2-layer Llama, hidden 256,
random weights, SmolLM2's tokenizer; kept in tandem's model cache so a peer can serve it too),
whose steps are so short that serving overhead shows; not a default, "gpu-0.5b" (Qwen2.5-0.5B's
shape, random weights, SmolLM2's tokenizer) for a lent GPU, which downloads nothing: `--source`
names a folder with SmolLM2's config.json and tokenizer files (deploy/gpu_run.sh).

The busy fraction is a worker's increase of `tandem:engine_busy_seconds_total` over a round's
wall time ("-" where /metrics lacks it; the in-process engine's is its time inside step()).
For disaggregated targets each round also reports (progress lines and JSON, `spans_ms`) the mean
over the round of the KV handover (prefill step's end to first token out), the KV transfer and
its part exposed after the prefill step, from their /metrics histograms: where TTFT goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.defaults import default_of  # noqa: E402
from cli.serve import parse_size  # noqa: E402
from engine.config import EngineConfig, default_batched_tokens  # noqa: E402
from loadtest import event_loop  # noqa: E402
from loadtest.client import (  # noqa: E402
    RequestResult,
    TextTiming,
    build_payload,
    send_request,
    stream_client,
)
from loadtest.config import RandomSpec, SamplingConfig, TargetConfig  # noqa: E402
from loadtest.datasets import sample_random  # noqa: E402
from loadtest.errors import BenchError, one_line  # noqa: E402
from loadtest.metrics import compute_metrics  # noqa: E402
from loadtest.quiet_peers import QuietPeers  # noqa: E402
from loadtest.sample import SampleRequest  # noqa: E402
from loadtest.serve_process import ServeError, ServeProcess  # noqa: E402
from loadtest.target import Target, build_target, resolve_model  # noqa: E402
from loadtest.token_count import LocalTokenizer, TokenCounter  # noqa: E402

if TYPE_CHECKING:  # torch loads with the engine: only the in-process target pays for it
    from transformers import PreTrainedTokenizerBase

    from engine.async_engine import AsyncEngine
    from protocol.sampling import SamplingParams

INPROCESS = "inprocess"
STEPPED = "stepped"  # not a default: the engine stepped in a plain loop (see stepped_session)
LAYOUTS = {  # served targets: their `tandem serve` layout flags
    "colocated": ("--mode", "colocated", "--prefill-workers", "0", "--decode-workers", "1"),
    "1p1d": ("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1"),
    # Every worker on every core (the cores oversubscribed 2x): the decode worker's steps get
    # both cores whenever the prefill worker idles.
    "1p1d-shared": ("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                    "--threads-per-worker", str(os.cpu_count() or 1)),
    # 1P1D on a fixed split: the decode worker on every core, the prefill worker on its share,
    # whoever computes (the default before the workers lent each other cores).
    "1p1d-fixed": ("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                   "--no-lend-cores"),
    # 1P1D with cost routing: the decode worker prefills a prompt itself when that is cheaper
    # than waiting behind the prefill worker's queue (conditional disaggregation).
    "1p1d-cost": ("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                  "--routing", "cost"),
    # 1P1D without the KV checksums: what their reads back cost the handover (on one GPU, each
    # waits on a stream the other worker's context shares by time slices).
    "1p1d-nochecksum": ("--mode", "disaggregated", "--prefill-workers", "1",
                        "--decode-workers", "1", "--no-kv-checksum"),
    # 1P1D with the KV over a shared-memory ring (the `ipc` transport) instead of gloo's TCP:
    # two memory copies a byte instead of the kernel's socket path, on the same two cores.
    "1p1d-ipc": ("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                 "--kv-transport", "ipc"),
    # Colocated with tokens streamed four at a time after the first (`--stream-interval 4`):
    # what the per-token HTTP path costs, as the throughput it gives back; burstier streams.
    "colocated-interval4": ("--mode", "colocated", "--prefill-workers", "0",
                            "--decode-workers", "1", "--stream-interval", "4"),
    # Not in the default targets: SmolLM2-135M's 9 heads do not split 2 ways (overhead's do).
    "colocated-tp2": ("--mode", "colocated", "--prefill-workers", "0", "--decode-workers", "1",
                      "--tensor-parallel-size", "2"),
}  # fmt: skip
TARGETS = (INPROCESS, STEPPED, *LAYOUTS)
DEFAULT_TARGETS = (INPROCESS, "colocated", "1p1d")
MODELS = ("smollm2", "overhead", "gpu-0.5b")
DEFAULT_MODELS = ("smollm2", "overhead")
# Random-weight Llamas made here once from a source model's vocabulary and tokenizer (kept in
# tandem's model cache, so a peer can serve them too): name -> (folder name, dimensions).
RANDOM_MODELS = {
    # steps so short that serving overhead shows
    "overhead": ("overhead-llama-l2-h256", {
        "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    }),
    # Qwen2.5-0.5B's shape (~0.45B parameters with SmolLM2's vocabulary): for a lent GPU, which
    # can download nothing (deploy/gpu_run.sh)
    "gpu-0.5b": ("gpu-llama-l24-h896", {
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
    }),
}  # fmt: skip
OVERHEAD_DIMS = RANDOM_MODELS["overhead"][1]
RANDOM_SEED = 0
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
PROMPT_SEED = 0
WARMUP_REQUESTS = 8
WARMUP_TOKENS = 16
BUSY_METRIC = "tandem:engine_busy_seconds_total"
SPAN_METRICS = {  # disaggregated targets: where a request's first token waits, mean per round
    "handover": "tandem:kv_handover_seconds",  # prefill step's end -> first token out
    "transfer": "tandem:kv_transfer_seconds",  # a request's KV transfer, first layer to done
    "exposed": "tandem:kv_transfer_exposed_seconds",  # of it, after the prefill step ended
}
SPAN_SKIPS_POOL = "decode"  # its workers time the same transfers from their side: not counted
STATS_SETTLE_S = 2.5  # the coordinator refreshes worker stats every second
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 10.0
LOCAL_HOSTS = ("127.0.0.1", "localhost")
LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
MEDIAN_KEYS = (*LATENCY_KEYS, "joined")
QUICK = {"models": ["overhead"], "concurrency": [16], "rounds": 1, "num_prompts": 16}


class SessionError(RuntimeError):
    """A target could not be measured this round (no server, a failed warm-up)."""


# ---- the random-weight models ----------------------------------------------------------------


def random_model(name: str, source: Path) -> Path:
    """The random-weight model `name`'s folder in tandem's model cache, written once from
    `source`."""
    from engine.fetch import cache_root

    folder, dims = RANDOM_MODELS[name]
    dest = cache_root() / "models" / folder
    if not (dest / "model.safetensors").is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{folder}-") as tmp:
            write_random_model(source, Path(tmp) / "model", dims)
            shutil.rmtree(dest, ignore_errors=True)
            (Path(tmp) / "model").rename(dest)  # whole or absent, never half-written
    return dest


def write_random_model(
    source: Path, dest: Path, dims: dict[str, int] = OVERHEAD_DIMS, seed: int = RANDOM_SEED
) -> Path:
    """A random-weight Llama of `dims` with `source`'s vocabulary and tokenizer files (`source`
    needs only its config.json and tokenizer files: no weights)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = json.loads((source / "config.json").read_text())
    special = {k: base.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **dims,
        **special,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    silent = silent_token_ids(AutoTokenizer.from_pretrained(str(source)), base["vocab_size"])
    with torch.no_grad():
        # Random weights may settle on a token that decodes to no text (a special token, part of
        # a UTF-8 character), and clients time only chunks carrying text. A zero row scores 0,
        # far below the largest of the other logits, so greedy decoding never picks these.
        model.lm_head.weight[silent] = 0.0
    model.to(torch.bfloat16).save_pretrained(dest)  # transformers 5 writes safetensors only
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    return dest


def silent_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[int]:
    """Ids whose text alone is empty or an incomplete character."""
    texts = (tokenizer.decode([i], skip_special_tokens=True) for i in range(vocab_size))
    return [i for i, text in enumerate(texts) if not text or "\ufffd" in text]


# ---- measuring one target --------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """What a target's counters say so far."""

    busy: dict[str, float]  # worker -> seconds its engine spent inside step()
    spans: dict[str, tuple[float, float]]  # SPAN_METRICS key -> (seconds summed, count)


class Endpoint(Protocol):
    """One target, up: sends a request and times it like `loadtest.client`; reads its
    counters (None where it has none)."""

    async def send(self, sample: SampleRequest) -> RequestResult: ...

    async def counters(self) -> Counters | None: ...


@dataclass(frozen=True)
class Round:
    """One target at one concurrency in one round."""

    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    joined: float  # 1 - text chunks / output tokens: the tokens beyond one a chunk (bursts)
    output_tokens: int
    completed: int
    failed: int
    duration_s: float
    busy: dict[str, float] | None  # worker -> busy fraction
    first_error: str | None
    spans_ms: dict[str, float] | None = None  # SPAN_METRICS key -> its mean over the round


async def drive(
    send: Callable[[SampleRequest], Awaitable[RequestResult]],
    samples: Sequence[SampleRequest],
    concurrency: int,
) -> tuple[list[RequestResult], float]:
    """`concurrency` streams, each sending the next unsent sample once its last one is done;
    returns the results in sample order and the wall time of it all."""
    pending = iter(range(len(samples)))  # shared: each next() happens on the event loop
    results: list[RequestResult | None] = [None] * len(samples)

    async def stream() -> None:
        for index in pending:
            results[index] = await send(samples[index])

    started = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(min(concurrency, len(samples)))))
    return [r for r in results if r is not None], time.perf_counter() - started


async def measure(
    endpoint: Endpoint, samples: Sequence[SampleRequest], concurrency: int, counter: TokenCounter
) -> Round:
    before = await endpoint.counters()
    results, wall_s = await drive(endpoint.send, samples, concurrency)
    after = await endpoint.counters()
    busy = busy_fractions(before and before.busy, after and after.busy, wall_s)
    return round_of(results, wall_s, busy, counter, span_means(before, after))


def round_of(
    results: list[RequestResult],
    wall_s: float,
    busy: dict[str, float] | None,
    counter: TokenCounter,
    spans_ms: dict[str, float] | None = None,
) -> Round:
    results = [with_output_tokens(r, counter) for r in results]
    m = compute_metrics(results, wall_s, (50.0, 99.0), None)
    return Round(
        output_tok_s=m.output_throughput,
        ttft_p50_ms=m.ttft.percentiles[50.0],
        ttft_p99_ms=m.ttft.percentiles[99.0],
        itl_p50_ms=m.itl.percentiles[50.0],
        itl_p99_ms=m.itl.percentiles[99.0],
        joined=joined_share(results),
        output_tokens=m.total_output,
        completed=m.completed,
        failed=m.failed,
        duration_s=wall_s,
        busy=busy,
        first_error=next((r.error for r in results if r.error), None),
        spans_ms=spans_ms,
    )


async def warm_up(endpoint: Endpoint, samples: Sequence[SampleRequest]) -> None:
    short = [s._replace(expected_output_len=WARMUP_TOKENS) for s in samples[:WARMUP_REQUESTS]]
    results = await asyncio.gather(*(endpoint.send(s) for s in short))
    if error := next((r.error for r in results if r.error), None):
        raise SessionError(f"a warm-up request failed: {error}")


async def measure_all(
    endpoint: Endpoint, workload: Workload, concurrencies: Sequence[int]
) -> dict[int, Round]:
    await warm_up(endpoint, workload.samples)
    return {
        c: await measure(endpoint, workload.for_concurrency(c), c, workload.counter)
        for c in concurrencies
    }


def joined_share(results: Sequence[RequestResult]) -> float:
    """1 - text chunks / output tokens over the successful requests: the share of tokens beyond
    one a chunk, 0 when every token came alone, 0.5 when they came in pairs. A server that falls
    behind joins tokens (tandem's `read_stream` does), so throughput alone would hide the
    bursts. Tokens without text of their own (an EOS, part of a character) count as joined."""
    done = [r for r in results if r.success and r.output_tokens and r.ttft is not None]
    tokens = sum(r.output_tokens or 0 for r in done)
    chunks = sum(min(len(r.itl) + 1, r.output_tokens or 0) for r in done)
    return 1.0 - chunks / tokens if tokens else 0.0


def with_output_tokens(result: RequestResult, counter: TokenCounter) -> RequestResult:
    """Counts the generated text of a server that sent no usage, as `tandem bench` does."""
    if not result.success or result.output_tokens is not None:
        return result
    return replace(result, output_tokens=counter.count(result.generated_text))


# ---- engine busy time ------------------------------------------------------------------------


def scrape(metrics_text: str) -> Counters:
    """Each worker's `tandem:engine_busy_seconds_total`, keyed by worker, and the sum and count
    of each SPAN_METRICS histogram (over its workers but decode ones), from Prometheus text."""
    busy: dict[str, float] = {}
    totals = {
        f"{metric}_{part}": 0.0 for metric in SPAN_METRICS.values() for part in ("sum", "count")
    }
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == BUSY_METRIC:
                busy[sample.labels.get("worker", "?")] = sample.value
            elif sample.name in totals and sample.labels.get("pool") != SPAN_SKIPS_POOL:
                totals[sample.name] += sample.value
    spans = {
        key: (totals[f"{metric}_sum"], totals[f"{metric}_count"])
        for key, metric in SPAN_METRICS.items()
    }
    return Counters(busy, spans)


def span_means(before: Counters | None, after: Counters | None) -> dict[str, float] | None:
    """Each span's mean over the window in ms, where the window counted some; else None."""
    if before is None or after is None:
        return None
    means = {}
    for key, (total, count) in after.spans.items():
        start_total, start_count = before.spans.get(key, (0.0, 0.0))
        if count > start_count:
            means[key] = 1000 * (total - start_total) / (count - start_count)
    return means or None


def busy_fractions(
    before: dict[str, float] | None, after: dict[str, float] | None, wall_s: float
) -> dict[str, float] | None:
    """Busy fraction of every worker counted at both ends (a restarted one, whose counter went
    back, is left out); None when the target does not count. A step running when the window
    opened counts whole when it ends, so a short round of a saturated engine can read slightly
    over 1: it is reported as 1."""
    if not before or not after or wall_s <= 0:
        return None
    return {
        worker: min(1.0, (after[worker] - before[worker]) / wall_s)
        for worker in sorted(before.keys() & after.keys())
        if after[worker] >= before[worker]
    } or None


# ---- endpoints -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineEndpoint:
    engine: AsyncEngine
    sampling: SamplingConfig
    timeout_s: float

    async def send(self, sample: SampleRequest) -> RequestResult:
        timing = TextTiming(sent_at=time.perf_counter())
        ids = self.engine.tokenizer.encode(
            sample.prompt
        )  # as the server encodes a completions prompt
        params = sampling_params(self.sampling, sample)
        try:
            await asyncio.wait_for(self._stream(ids, params, timing), self.timeout_s)
            error = None
        except asyncio.TimeoutError:
            error = f"timed out after {self.timeout_s:g} s"
        except Exception as err:  # the engine's failure of this request, recorded as HTTP's are
            error = f"{type(err).__name__}: {one_line(str(err))}"
        return timing.result(len(ids), error)

    async def _stream(self, ids: list[int], params: SamplingParams, timing: TextTiming) -> None:
        async for output in self.engine.generate(ids, params):
            if output.delta_text:
                timing.on_text(output.delta_text, time.perf_counter())
            timing.output_tokens = len(output.token_ids)

    async def counters(self) -> Counters:
        # The engine thread's own step timer: the span the servers' counter covers.
        seconds = float(self.engine.step_fields().get("engine_busy_seconds", 0.0))
        return Counters({"engine": seconds}, {})


def sampling_params(sampling: SamplingConfig, sample: SampleRequest) -> SamplingParams:
    """What the in-process targets ask the engine for: the HTTP targets' request, EOS ignored."""
    from protocol.sampling import SamplingParams

    return SamplingParams(
        max_tokens=sample.expected_output_len,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        ignore_eos=True,
    )


@dataclass
class HttpEndpoint:
    client: aiohttp.ClientSession
    target: Target
    sampling: SamplingConfig
    base_url: str
    timeout_s: float
    counts: bool | None = None  # None until /metrics is first read

    async def send(self, sample: SampleRequest) -> RequestResult:
        payload = build_payload(self.target, sample, self.sampling)
        return await send_request(
            self.client, self.target, payload, sample.prompt_len, self.timeout_s
        )

    async def counters(self) -> Counters | None:
        if self.counts is False:
            return None
        await asyncio.sleep(STATS_SETTLE_S)  # the last requests' steps reach /metrics
        try:
            fetch = _get_text(self.client, self.base_url + "/metrics")
            status, text = await asyncio.wait_for(fetch, METRICS_TIMEOUT_S)
            counters = scrape(text) if status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):  # ValueError: not Prometheus'
            counters = None
        self.counts = counters is not None and bool(counters.busy)
        return counters if self.counts else None


async def _get_text(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with client.get(url) as response:
        return response.status, await response.text()


# ---- sessions: one target up, measured, down -------------------------------------------------


@dataclass(frozen=True)
class Workload:
    samples: list[SampleRequest]  # the most any concurrency sends
    counter: TokenCounter
    num_prompts: int | None  # per round; None: 2 x concurrency
    sampling: SamplingConfig  # every target's requests (EOS ignored)

    def for_concurrency(self, concurrency: int) -> list[SampleRequest]:
        return self.samples[: self.num_prompts or 2 * concurrency]


def make_workload(model: Path, args: argparse.Namespace) -> Workload:
    counter = LocalTokenizer(model)
    count = args.num_prompts or 2 * max(args.concurrency)
    spec = RandomSpec(input_len=args.input_len, output_len=args.output_len)
    samples = sample_random(spec, count, np.random.default_rng(PROMPT_SEED), counter)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, ignore_eos=True)
    return Workload(samples, counter, args.num_prompts, sampling)


def engine_session(model: Path, workload: Workload, args: argparse.Namespace) -> dict[int, Round]:
    import torch

    from engine.async_engine import AsyncEngine
    from engine.engine import LLMEngine
    from engine.tokenizer import Tokenizer

    # What tandem serve gives its one colocated worker: every core on the engine thread (or
    # --engine-threads), one on the thread that loads the model (so the process holds one OpenMP
    # team, kernels/threads.py).
    torch.set_num_threads(1)
    engine = LLMEngine(engine_config(model, args))
    threads = args.engine_threads or os.cpu_count() or 1
    async_engine = AsyncEngine(engine, Tokenizer(model), num_threads=threads)
    endpoint = EngineEndpoint(async_engine, workload.sampling, args.request_timeout)
    return event_loop.run(_engine_rounds(endpoint, workload, args.concurrency))


async def _engine_rounds(
    endpoint: EngineEndpoint, workload: Workload, concurrencies: Sequence[int]
) -> dict[int, Round]:
    try:
        return await measure_all(endpoint, workload, concurrencies)
    finally:  # while the loop the engine delivers to still runs
        endpoint.engine.shutdown()


def stepped_session(model: Path, workload: Workload, args: argparse.Namespace) -> dict[int, Round]:
    """The engine stepped in a plain loop on this thread: no asyncio, no detokenizing, no HTTP;
    the same closed loop of `concurrency` streams over the same prompts. Its rate is the
    ceiling of the other targets: on a GPU, where a step takes 2-3 ms, the in-process target's
    client and asyncio wrapper share the engine's GIL and fall below it (docs/performance.md)."""
    import torch

    from engine.engine import LLMEngine
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(args.engine_threads or os.cpu_count() or 1)
    engine = LLMEngine(engine_config(model, args))
    tokenizer = Tokenizer(model)
    warm = [s._replace(expected_output_len=WARMUP_TOKENS) for s in workload.samples]
    rounds = {}
    try:
        run_stepped(engine, tokenizer, warm[:WARMUP_REQUESTS], WARMUP_REQUESTS, workload, args)
        for c in args.concurrency:
            samples = workload.for_concurrency(c)
            results, wall_s, busy_s = run_stepped(engine, tokenizer, samples, c, workload, args)
            rounds[c] = round_of(results, wall_s, {"engine": busy_s / wall_s}, workload.counter)
    finally:  # tensor-parallel followers end with it
        engine.close()
    return rounds


def run_stepped(
    engine, tokenizer, samples: Sequence[SampleRequest], concurrency: int, workload: Workload,
    args: argparse.Namespace,
) -> tuple[list[RequestResult], float, float]:  # fmt: skip
    """Results in sample order, the wall time, and the time spent inside step()."""
    from protocol.messages import RequestFailed

    ids = [tokenizer.encode(s.prompt) for s in samples]
    queue = iter(range(len(samples)))
    sent_at: dict[int, float] = {}
    arrivals: dict[int, list[float]] = {i: [] for i in range(len(samples))}
    errors: dict[int, str] = {}

    def add() -> int:
        index = next(queue, None)
        if index is None:
            return 0
        sent_at[index] = time.perf_counter()
        params = sampling_params(workload.sampling, samples[index])
        engine.add_request(f"s{index}", ids[index], params)
        return 1

    started = time.perf_counter()
    deadline = started + args.request_timeout * max(1, len(samples) // max(1, concurrency))
    in_flight = sum(add() for _ in range(concurrency))
    busy_s = 0.0
    while in_flight:
        if time.perf_counter() > deadline:
            raise SessionError(f"stepped engine: {in_flight} requests unfinished at the deadline")
        before = time.perf_counter()
        updates = engine.step()
        now = time.perf_counter()
        busy_s += now - before
        for update in updates:
            index = int(update.request_id[1:])
            if isinstance(update, RequestFailed):
                errors[index] = update.reason
            else:
                arrivals[index].extend([now] * len(update.token_ids))
                if update.finish_reason is None:
                    continue
            in_flight += add() - 1
    wall_s = time.perf_counter() - started
    return [_stepped_result(i, ids, sent_at, arrivals, errors) for i in sent_at], wall_s, busy_s


def _stepped_result(
    index: int,
    ids: list[list[int]],
    sent_at: dict[int, float],
    arrivals: dict[int, list[float]],
    errors: dict[int, str],
) -> RequestResult:
    times, sent = arrivals[index], sent_at[index]
    return RequestResult(
        prompt_len=len(ids[index]),
        sent_at=sent,
        ttft=times[0] - sent if times else None,
        itl=tuple(b - a for a, b in zip(times, times[1:], strict=False)),
        latency=times[-1] - sent if times else None,
        output_tokens=len(times),
        generated_text="",
        error=errors.get(index),
    )


def engine_config(model: Path, args: argparse.Namespace) -> EngineConfig:
    """The engine every served worker runs, from the same flags serve_args passes on."""
    return EngineConfig(
        model=model,
        dtype=args.dtype,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_seqs=max_num_seqs(args),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        device=device(args),
        cuda_graphs=not args.enforce_eager,
    )


def device(args: argparse.Namespace) -> str:
    """`--device`, with auto resolved as `tandem serve` resolves it (cuda if present)."""
    if args.device != "auto":
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def max_num_seqs(args: argparse.Namespace) -> int:
    return max(64, *args.concurrency)


def serve_args(model: Path, layout: str, args: argparse.Namespace) -> list[str]:
    extra = ["--threads-per-worker", str(args.engine_threads)] if args.engine_threads else []
    if args.gpus_per_worker is not None:
        extra += ["--gpus-per-worker", str(args.gpus_per_worker)]
    if args.enforce_eager:
        extra.append("--enforce-eager")
    return ["--model", str(model), *LAYOUTS[layout], "--no-prefix-caching", "--dtype", args.dtype,
            "--kv-cache-memory", str(args.kv_cache_memory),
            "--max-num-seqs", str(max_num_seqs(args)), "--log-level", "warning",
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--device", args.device,
            *extra]  # fmt: skip


def served_session(
    model: Path, layout: str, workload: Workload, args: argparse.Namespace, work: Path
) -> dict[int, Round]:
    log = work / f"{model.name}-{layout}.log"
    with ServeProcess(serve_args(model, layout, args), log) as server:
        try:
            server.wait_healthy(START_TIMEOUT_S)
            rounds = http_session(server.url, workload, args)
        except (SessionError, BenchError) as err:
            raise SessionError(f"{err}\n--- server log ---\n{server.log}") from err
        except ServeError as err:
            raise SessionError(str(err)) from err
        if server.stop(STOP_TIMEOUT_S) != 0:
            print(f"warning: {layout} did not exit cleanly:\n{server.log}", file=sys.stderr)
    return rounds


def http_session(base_url: str, workload: Workload, args: argparse.Namespace) -> dict[int, Round]:
    config = TargetConfig(base_url, "/v1/completions", None, None, args.request_timeout)
    with httpx.Client(timeout=CONNECT_TIMEOUT_S, trust_env=False) as http:
        target = build_target(config, resolve_model(http, config))
    return event_loop.run(_http_rounds(target, base_url, workload, args))


async def _http_rounds(
    target: Target, base_url: str, workload: Workload, args: argparse.Namespace
) -> dict[int, Round]:
    # One connection per stream, kept (plus one for /metrics).
    async with stream_client(max(args.concurrency) + 1) as client:
        endpoint = HttpEndpoint(
            client, target, workload.sampling, base_url.rstrip("/"), args.request_timeout
        )
        return await measure_all(endpoint, workload, args.concurrency)


def run_session(
    target: str, model: Path, workload: Workload, args: argparse.Namespace, work: Path
) -> dict[int, Round]:
    if target == INPROCESS:
        return engine_session(model, workload, args)
    if target == STEPPED:
        return stepped_session(model, workload, args)
    if target in LAYOUTS:
        return served_session(model, target, workload, args, work)
    return http_session(args.peers[target], workload, args)


# ---- the run and its summary -----------------------------------------------------------------

Key = tuple[str, int, str]  # (model, concurrency, target)


@dataclass
class Results:
    rounds: dict[Key, list[Round]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def run_benchmark(models: dict[str, Path], args: argparse.Namespace, work: Path) -> Results:
    """Every model: rounds of every target in turn, one target up at a time."""
    results = Results()
    targets = [*args.targets, *args.peers]
    with QuietPeers(args.peers, args.pause_peers) as quiet:
        for name, folder in models.items():
            workload = make_workload(folder, args)
            for index in range(args.rounds):
                for target in targets:
                    quiet.only(target if target in args.peers else None)
                    measure_round(results, name, index, target, folder, workload, args, work)
    return results


def measure_round(
    results: Results,
    name: str,
    index: int,
    target: str,
    folder: Path,
    workload: Workload,
    args: argparse.Namespace,
    work: Path,
) -> None:
    label = f"[{name} round {index + 1}/{args.rounds}] {target}"
    print(f"--- {label}", file=sys.stderr, flush=True)
    try:
        measured = run_session(target, folder, workload, args, work)
    except (SessionError, BenchError, OSError) as err:
        results.failures.append(f"{label}: {one_line(str(err), 300)}")
        print(f"{label} failed: {err}", file=sys.stderr, flush=True)
        return
    for concurrency, round_ in measured.items():
        results.rounds.setdefault((name, concurrency, target), []).append(round_)
        print(f"{label} c={concurrency}: {progress(round_)}", file=sys.stderr)


def progress(r: Round) -> str:
    failed = f", {r.failed} failed (first: {r.first_error})" if r.failed else ""
    spans = "".join(f", {k} {v:.0f} ms" for k, v in (r.spans_ms or {}).items())
    return (
        f"{r.output_tok_s:.1f} tok/s, TTFT p50 {r.ttft_p50_ms:.0f} ms, ITL p50 "
        f"{r.itl_p50_ms:.1f} ms, joined {r.joined:.0%}, busy {format_busy(r.busy)}{spans}{failed}"
    )


def summarize(rounds: Sequence[Round], inprocess: Sequence[Round] | None) -> dict:
    """Medians over rounds (tok/s with its min and max), and served / in-process tok/s."""
    tok_s = [r.output_tok_s for r in rounds]
    base = statistics.median(r.output_tok_s for r in inprocess) if inprocess else None
    busy = medians([r.busy for r in rounds], sorted({w for r in rounds for w in (r.busy or {})}))
    spans = medians([r.spans_ms for r in rounds], SPAN_METRICS)
    return {
        "rounds": len(rounds),
        "output_tok_s": statistics.median(tok_s),
        "output_tok_s_min": min(tok_s),
        "output_tok_s_max": max(tok_s),
        "vs_inprocess": statistics.median(tok_s) / base if base else None,
        **{key: statistics.median(getattr(r, key) for r in rounds) for key in MEDIAN_KEYS},
        "busy": busy or None,
        "spans_ms": spans or None,
        "failed": sum(r.failed for r in rounds),
    }


def medians(per_round: Sequence[dict[str, float] | None], keys: Iterable[str]) -> dict:
    """Each key's median over the rounds that have it, for the keys some round has."""
    have = [d for d in per_round if d]
    return {
        k: statistics.median(d[k] for d in have if k in d)
        for k in keys
        if any(k in d for d in have)
    }


def summaries(results: Results) -> dict[Key, dict]:
    return {
        (model, c, target): summarize(rounds, results.rounds.get((model, c, INPROCESS)))
        for (model, c, target), rounds in results.rounds.items()
    }


HEADINGS = ("model", "conc", "target", "out tok/s", "min-max", "vs in-proc", "TTFT p50", "p99",
            "ITL p50", "p99", "joined", "busy", "failed")  # fmt: skip


def format_busy(busy: dict[str, float] | None) -> str:
    return "-" if not busy else " ".join(f"{w} {v:.0%}" for w, v in busy.items())


def table_row(key: Key, s: dict) -> list[str]:
    model, concurrency, target = key
    ratio = "-" if s["vs_inprocess"] is None else f"{s['vs_inprocess']:.2f}x"
    spread = f"{s['output_tok_s_min']:.0f}-{s['output_tok_s_max']:.0f}"
    latencies = [f"{s[k]:.1f}" for k in LATENCY_KEYS]
    tok_s = f"{s['output_tok_s']:.1f}"
    busy = format_busy(s["busy"])
    return [
        model,
        str(concurrency),
        target,
        tok_s,
        spread,
        ratio,
        *latencies,
        f"{s['joined']:.0%}",
        busy,
        str(s["failed"]),
    ]


def format_table(rows: dict[Key, dict], order: Sequence[str]) -> str:
    keys = sorted(rows, key=lambda k: (k[0], k[1], order.index(k[2])))
    table = [list(HEADINGS), *(table_row(key, rows[key]) for key in keys)]
    widths = [max(len(cell) for cell in column) for column in zip(*table, strict=True)]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    legend = (
        "tok/s: median over rounds (min-max); latencies in ms, medians of each round's "
        "percentile; joined: 1 - text chunks / output tokens (the tokens beyond one a chunk); "
        "busy: engine time in step() / wall time"
    )
    return "\n".join([*lines, legend])


def report_json(results: Results, rows: dict[Key, dict], settings: dict) -> dict:
    return {
        "settings": settings,
        "rows": [
            {
                "model": m,
                "concurrency": c,
                "target": t,
                **rows[(m, c, t)],
                "per_round": [asdict(r) for r in results.rounds[(m, c, t)]],
            }
            for (m, c, t) in rows
        ],
        "failures": results.failures,
    }


# ---- command line ----------------------------------------------------------------------------


def parse_peer(text: str) -> tuple[str, str]:
    """'vllm=http://127.0.0.1:8100' -> ('vllm', 'http://127.0.0.1:8100'); this host only."""
    name, sep, url = text.partition("=")
    if not sep or not name or name in TARGETS:
        raise argparse.ArgumentTypeError(
            f"--peer {text!r}: expected NAME=URL, NAME not one of {', '.join(TARGETS)}"
        )
    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL:
        host = None
    if not url.startswith("http://") or host not in LOCAL_HOSTS:
        raise argparse.ArgumentTypeError(f"--peer {text!r}: the URL must be http://127.0.0.1:PORT")
    return name, url.rstrip("/")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS))
    p.add_argument(
        "--source",
        type=Path,
        metavar="DIR",
        help="the folder whose config.json and tokenizer files the random-weight "
        "models take (default: SmolLM2-135M-Instruct, fetched if missing)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="every engine's, in-process and served (auto: cuda if present)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="streams")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, help="per round (default: 2 x concurrency)")
    p.add_argument("--input-len", type=int, default=100, help="prompt tokens (words)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-p", type=float, help="nucleus sampling (default: none sent)")
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(DEFAULT_TARGETS))
    p.add_argument(
        "--peer",
        type=parse_peer,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an OpenAI-compatible server on this host, serving the one --models",
    )
    p.add_argument(
        "--pause-peers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop each peer's process group (SIGSTOP) while other targets run, continue it "
        "for its own rounds (loadtest/quiet_peers.py; default: on)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-cache-memory", type=parse_size, default=512 << 20, metavar="BYTES",
                   help="KV cache per engine, e.g. 512MiB (default: 512MiB)")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   default=default_of(EngineConfig, "max_num_batched_tokens"),
                   help="token budget of every engine's step, in-process and served "
                        "(default: EngineConfig's for the device)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--engine-threads", type=int, metavar="N",
                   help="torch threads of every engine, in-process and served (default: the "
                        "in-process engine and a colocated worker get every core; "
                        "coordinator/builder.py splits them in 1P1D)")  # fmt: skip
    p.add_argument("--gpus-per-worker", type=float, metavar="FRACTION",
                   help="each served worker's share of a GPU (0.5: 1P1D on one GPU; default: "
                        "tandem serve's, one GPU each)")  # fmt: skip
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, every engine's decode steps eager (no CUDA graphs)",
    )
    p.add_argument("--quick", action="store_true", help="1 round, concurrency 16, overhead model")
    p.add_argument("--json", type=Path, help="write the summary and every round here")
    args = p.parse_args(argv)
    if args.quick:  # its settings become the defaults: flags given still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    args.peers = dict(args.peer)
    if args.peers and len(args.models) > 1:
        p.error("a peer serves one model: give --models one model with --peer")
    if min(args.concurrency) < 1 or args.rounds < 1 or (args.num_prompts or 1) < 1:
        p.error("--concurrency, --rounds and --num-prompts must be at least 1")
    if args.engine_threads is not None and args.engine_threads < 1:
        p.error("--engine-threads must be at least 1")
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = default_batched_tokens(device(args))
    if args.max_num_batched_tokens < 1:
        p.error("--max-num-batched-tokens must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.fetch import fetch_default_model

    smollm2 = fetch_default_model() if "smollm2" in args.models or not args.source else None
    source = args.source or smollm2
    models = {m: smollm2 if m == "smollm2" else random_model(m, source) for m in args.models}
    print("models: " + ", ".join(f"{m} {folder}" for m, folder in models.items()), file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="serving-") as work:
        results = run_benchmark(models, args, Path(work))
    rows = summaries(results)
    print("\n" + format_table(rows, [*args.targets, *args.peers]))
    for failure in results.failures:
        print(f"failed: {failure}")
    if args.json:
        settings = {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("peer", "json", "quick")
        }
        settings["models"] = {name: str(folder) for name, folder in models.items()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report_json(results, rows, settings), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if results.failures or any(s["failed"] for s in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
