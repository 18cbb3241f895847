"""Soak test of a served tandem: steady mixed load, periodic samples, a verdict on the targets.

A steady mixed load for a set time; the server's processes, KV usage and latencies sampled at
intervals; then a verdict against the soak targets.

    python benchmarks/soak.py [--duration 600] [--warmup 60] [--sample-every 15] [--concurrency 8] \
        [--disconnect-fraction 0.1] [--model DIR] [--json out.json] [--serve-args ARG ...]
    python benchmarks/soak.py --url http://127.0.0.1:8000 [--pid PID]   # a server already running
    python benchmarks/soak.py --smoke                                  # about 20 s of load

Without --url it starts `tandem serve --mode disaggregated --prefill-workers 1 --decode-workers 1`
(plus --model and whatever follows --serve-args) and stops it at the end. Load: `--concurrency`
clients, each sending one streamed /v1/completions after another until the deadline, drawn from a
fixed pool of short (~20 tokens, 32 out) and long (~400 tokens, 64 out) prompts, greedy, EOS
ignored; a `--disconnect-fraction` of requests closes its stream after a few tokens. GET /ready
is probed every second. Every `--sample-every` s: RSS and CPU time of the server and all its
descendants (Ray workers included; psutil when installed, else /proc), each worker's
`tandem:kv_cache_usage_perc` from /metrics, and TTFT / ITL / e2e percentiles of the requests
completed in that window.

Targets, checked at the end: RSS growth < 5% per process and in total, from the first sample at or
after `--warmup` to the last; the tree's idle CPU% (measured for `--idle` s before and after the
load) back to its start; KV usage 0 on every worker after the load; no error (every request not
closed on purpose got 200 and all its tokens, greedy texts of one prompt all equal, every /ready
200); TTFT and ITL p50 within 5% between the first window starting after the warm-up and the last.
Exits 0 when every target is met.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.client import build_payload, send_request, stream_client  # noqa: E402
from loadtest.config import SamplingConfig  # noqa: E402
from loadtest.errors import BenchError, one_line  # noqa: E402
from loadtest.prompts import synthesize_text  # noqa: E402
from loadtest.sample import SampleRequest  # noqa: E402
from loadtest.serve_process import ServeError, ServeProcess  # noqa: E402
from loadtest.sse import parse_sse_line  # noqa: E402
from loadtest.target import Target  # noqa: E402
from loadtest.token_count import ServerTokenizer  # noqa: E402

try:
    import psutil
except ImportError:  # /proc is read instead
    psutil = None

SERVE_ARGS = ("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1")
SHAPES = ((20, 32), (400, 64))  # (prompt tokens, output tokens): short, long
PROMPTS_PER_SHAPE = 8  # a fixed pool, so every prompt recurs and its greedy text can be compared
SAMPLING = SamplingConfig(temperature=0.0, ignore_eos=True)
DISCONNECT_AFTER_CHUNKS = 3
READY_EVERY_S = 1.0
PROBE_TIMEOUT_S = 10.0
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
KV_SETTLE_S = 30.0  # worker stats reach /metrics with a delay
EXIT_WAIT_S = 10.0
KV_METRIC = "tandem:kv_cache_usage_perc"
RSS_GROWTH_LIMIT = 0.05
RSS_NOISE_BYTES = 2 << 20  # a process growing by less than this passes whatever its percentage
P50_DRIFT_LIMIT = 0.05
MAX_MESSAGES = 20
MIB = float(1 << 20)
DEFAULTS = {"duration": 600.0, "warmup": 60.0, "sample_every": 15.0, "idle": 5.0,
            "concurrency": 8, "request_timeout": 120.0}  # fmt: skip
SMOKE = {"duration": 12.0, "warmup": 4.0, "sample_every": 4.0, "idle": 2.0,
         "concurrency": 4, "request_timeout": 60.0}  # fmt: skip


class SoakError(RuntimeError):
    """The soak could not run (no server, a failed first request); printed as is."""


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float
    warmup_s: float
    sample_every_s: float
    idle_s: float
    concurrency: int
    disconnect_fraction: float
    long_fraction: float
    request_timeout_s: float
    idle_cpu_tolerance_pct: float
    seed: int


# ---- processes -----------------------------------------------------------------------------


class ProcStat(NamedTuple):
    pid: int
    label: str  # the command line, cut (Ray sets its workers' to `ray::DecodeWorker...`)
    rss_bytes: int
    cpu_s: float  # user + system


def process_tree(root: int) -> dict[int, ProcStat]:
    """`root` and every descendant still running, by pid; {} once root is gone."""
    return _psutil_tree(root) if psutil is not None else _proc_tree(root)


def _psutil_tree(root: int) -> dict[int, ProcStat]:
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return {}
    stats = {}
    for proc in procs:
        try:
            with proc.oneshot():
                times, label = proc.cpu_times(), _label(proc.cmdline()) or proc.name()
                rss = proc.memory_info().rss
        except psutil.Error:  # exited meanwhile
            continue
        stats[proc.pid] = ProcStat(proc.pid, label, rss, times.user + times.system)
    return stats


def _proc_tree(root: int) -> dict[int, ProcStat]:
    fields = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _read_stat(int(entry.name))) is not None:
            fields[int(entry.name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in fields.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root] if root in fields else []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    return {
        pid: ProcStat(pid, _cmdline(pid), fields[pid][2] * page, fields[pid][1] / tick)
        for pid in found
    }


def _read_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, utime + stime in ticks, rss in pages) from /proc/PID/stat; None for a process
    that is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    if rest[0] == "Z":
        return None
    return int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[21])


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return _label(raw.decode(errors="replace").split("\0")) or "?"


def _label(argv: Sequence[str]) -> str:
    """A command line cut to 60 characters, its absolute paths to their last part."""
    return one_line(" ".join(Path(a).name if a.startswith("/") else a for a in argv), 60)


def cpu_pct(before: dict[int, ProcStat], after: dict[int, ProcStat], wall_s: float) -> float:
    """CPU% (100 = one core) of the processes present at both ends over `wall_s`."""
    used = sum(after[pid].cpu_s - before[pid].cpu_s for pid in after.keys() & before.keys())
    return 100.0 * used / wall_s if wall_s > 0 else 0.0


def still_running(pids: Sequence[int]) -> list[int]:
    return [pid for pid in pids if _read_stat(pid) is not None]


# ---- /metrics and latencies ----------------------------------------------------------------


def kv_usage(metrics_text: str) -> dict[str, float]:
    """Each worker's KV usage (0..1) from Prometheus text, keyed `pool/worker`."""
    usage = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == KV_METRIC:
                labels = sample.labels
                usage[f"{labels.get('pool', '?')}/{labels.get('worker', '?')}"] = sample.value
    return usage


class Percentiles(NamedTuple):
    p50_ms: float
    p99_ms: float


def percentiles(values_s: Sequence[float]) -> Percentiles | None:
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return Percentiles(float(np.percentile(ms, 50)), float(np.percentile(ms, 99)))


class Outcome(NamedTuple):
    """One request as the soak saw it; times in seconds, `finished_at` on the monotonic clock."""

    finished_at: float
    disconnected: bool  # closed on purpose after a few tokens
    ttft: float | None
    itl: tuple[float, ...]
    latency: float | None
    error: str | None


@dataclass(frozen=True)
class Window:
    """The requests that finished in one sampling window."""

    completed: int
    disconnected: int
    errors: int
    ttft: Percentiles | None
    itl: Percentiles | None
    e2e: Percentiles | None


def window_of(outcomes: Sequence[Outcome]) -> Window:
    good = [o for o in outcomes if o.error is None and not o.disconnected]
    return Window(
        completed=len(good),
        disconnected=sum(o.disconnected and o.error is None for o in outcomes),
        errors=sum(o.error is not None for o in outcomes),
        ttft=percentiles([o.ttft for o in good if o.ttft is not None]),
        itl=percentiles([gap for o in good for gap in o.itl]),
        e2e=percentiles([o.latency for o in good if o.latency is not None]),
    )


@dataclass(frozen=True)
class Sample:
    t_s: float  # since the load started
    window_start_s: float
    processes: dict[int, ProcStat]
    cpu_pct: float | None  # of the whole tree over the window; None for the first sample
    kv: dict[str, float] | None  # None: /metrics did not answer
    window: Window

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.processes.values())


# ---- the load ------------------------------------------------------------------------------


@dataclass
class Tally:
    """Everything the load tasks record; mutated only on the event loop."""

    outcomes: list[Outcome] = field(default_factory=list)
    references: dict[int, str] = field(default_factory=dict)  # prompt index -> first greedy text
    mismatches: int = 0
    ready_probes: int = 0
    ready_failures: int = 0
    metrics_failures: int = 0
    messages: dict[str, int] = field(default_factory=dict)  # distinct problem -> times seen

    def note(self, message: str) -> None:
        message = one_line(message)
        if message in self.messages or len(self.messages) < MAX_MESSAGES:
            self.messages[message] = self.messages.get(message, 0) + 1


@dataclass(frozen=True)
class Load:
    streams: aiohttp.ClientSession  # the requests timed, read as `tandem bench` reads them
    client: httpx.AsyncClient  # the requests that disconnect early
    probes: httpx.AsyncClient  # its own pool, so probes never queue behind requests
    target: Target
    base_url: str
    prompts: list[SampleRequest]
    config: SoakConfig
    tally: Tally

    async def complete(self, index: int) -> Outcome:
        prompt = self.prompts[index]
        payload = build_payload(self.target, prompt, SAMPLING)
        timeout = self.config.request_timeout_s
        r = await send_request(self.streams, self.target, payload, prompt.prompt_len, timeout)
        error = r.error
        if error is None and r.output_tokens != prompt.expected_output_len:
            error = f"{r.output_tokens} of {prompt.expected_output_len} tokens"
        if error is None:
            error = self._compare(index, r.generated_text)
        if error is not None:
            self.tally.note(f"prompt {index}: {error}")
        return Outcome(time.monotonic(), False, r.ttft, r.itl, r.latency, error)

    def _compare(self, index: int, text: str) -> str | None:
        """None when `text` is the first complete greedy text of prompt `index` or equals it."""
        first = self.tally.references.setdefault(index, text)
        if text == first:
            return None
        self.tally.mismatches += 1
        at = len(os.path.commonprefix([first, text]))
        return (
            f"greedy text of prompt {index} differs from its first one from character {at}: "
            f"{first[at : at + 24]!r} then, {text[at : at + 24]!r} now"
        )

    async def disconnect(self, index: int) -> Outcome:
        payload = build_payload(self.target, self.prompts[index], SAMPLING)
        try:
            error = await asyncio.wait_for(self._read_a_few(payload), self.config.request_timeout_s)
        except asyncio.TimeoutError:
            error = "timed out before the first tokens"
        except httpx.HTTPError as err:
            error = f"{type(err).__name__}: {err}"
        if error is not None:
            self.tally.note(f"prompt {index} (to disconnect): {error}")
        return Outcome(time.monotonic(), True, None, (), None, error)

    async def _read_a_few(self, payload: dict) -> str | None:
        """Reads DISCONNECT_AFTER_CHUNKS text chunks, then leaves: closing a response that is
        not read to its end closes the connection, which the server sees as a disconnect."""
        stream = self.client.stream("POST", self.target.url, json=payload)
        async with stream as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            chunks = 0
            async for line in response.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if event.error is not None:
                    return event.error
                chunks += bool(event.text)
                if chunks >= DISCONNECT_AFTER_CHUNKS or event.done:
                    return None
        return "the stream ended before the first tokens"

    async def client_loop(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            shape = int(rng.random() < self.config.long_fraction)
            index = shape * PROMPTS_PER_SHAPE + rng.randrange(PROMPTS_PER_SHAPE)
            if rng.random() < self.config.disconnect_fraction:
                self.tally.outcomes.append(await self.disconnect(index))
            else:
                self.tally.outcomes.append(await self.complete(index))

    async def ready_loop(self, deadline: float) -> None:
        while (started := time.monotonic()) < deadline:
            self.tally.ready_probes += 1
            try:
                response = await self.probes.get(self.base_url + "/ready")
                problem = None if response.status_code == 200 else f"HTTP {response.status_code}"
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {err}"
            if problem is not None:
                self.tally.ready_failures += 1
                self.tally.note(f"/ready: {problem}")
            await asyncio.sleep(max(0.0, started + READY_EVERY_S - time.monotonic()))

    async def scrape_kv(self) -> dict[str, float] | None:
        try:
            response = await self.probes.get(self.base_url + "/metrics")
            response.raise_for_status()
            return kv_usage(response.text)
        except (httpx.HTTPError, ValueError) as err:
            self.tally.metrics_failures += 1
            self.tally.note(f"/metrics: {type(err).__name__}: {err}")
            return None


async def sample_loop(load: Load, root: int | None, start: float, deadline: float) -> list[Sample]:
    """A sample at the start, one every `sample_every_s`, and a last one at the deadline."""

    async def tree() -> dict[int, ProcStat]:  # off the loop: a /proc scan would delay streams
        return {} if root is None else await asyncio.to_thread(process_tree, root)

    samples = [Sample(0.0, 0.0, await tree(), None, await load.scrape_kv(), window_of([]))]
    next_at = start + load.config.sample_every_s
    while True:
        due = min(next_at, deadline)
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        now, previous = time.monotonic(), samples[-1]
        opened = start + previous.t_s
        finished = [o for o in load.tally.outcomes if opened < o.finished_at <= now]
        processes = await tree()
        cpu = cpu_pct(previous.processes, processes, now - opened) if root is not None else None
        kv = await load.scrape_kv()
        samples.append(Sample(now - start, previous.t_s, processes, cpu, kv, window_of(finished)))
        print(progress(samples[-1]), file=sys.stderr, flush=True)
        if due >= deadline:
            return samples
        next_at += load.config.sample_every_s


async def idle_cpu(root: int | None, seconds: float) -> float | None:
    if root is None:
        return None
    before, started = process_tree(root), time.monotonic()
    await asyncio.sleep(seconds)
    return cpu_pct(before, process_tree(root), time.monotonic() - started)


async def settle_kv(load: Load) -> dict[str, float] | None:
    """KV usage once every worker reports 0, or as it stands after KV_SETTLE_S."""
    deadline = time.monotonic() + KV_SETTLE_S
    while True:
        usage = await load.scrape_kv()
        if (usage and not any(usage.values())) or time.monotonic() > deadline:
            return usage
        await asyncio.sleep(1.0)


def build_prompts(base_url: str, model: str, seed: int) -> list[SampleRequest]:
    """PROMPTS_PER_SHAPE short prompts, then as many long ones, counted by the server."""
    rng = np.random.default_rng(seed)
    with httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
        counter = ServerTokenizer(client, base_url, model)
        return [
            SampleRequest(*synthesize_text(input_len, rng, counter), output_len)
            for input_len, output_len in SHAPES
            for _ in range(PROMPTS_PER_SHAPE)
        ]


def served_model(base_url: str) -> str:
    try:
        response = httpx.get(base_url + "/v1/models", timeout=PROBE_TIMEOUT_S, trust_env=False)
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, LookupError, TypeError) as err:
        raise SoakError(f"{base_url}/v1/models lists no model: {err}") from err


@dataclass(frozen=True)
class Measurements:
    samples: list[Sample]
    idle_before_pct: float | None
    idle_after_pct: float | None
    kv_after: dict[str, float] | None
    tally: Tally


async def soak(config: SoakConfig, base_url: str, root: int | None) -> Measurements:
    model = served_model(base_url)
    prompts = await asyncio.to_thread(build_prompts, base_url, model, config.seed)
    target = Target(base_url + "/v1/completions", model, {}, is_chat=False)
    timeout = httpx.Timeout(config.request_timeout_s, connect=PROBE_TIMEOUT_S)
    limits = httpx.Limits(max_connections=config.concurrency + 1)
    async with (
        stream_client(config.concurrency + 1) as streams,
        httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client,
        httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as probes,
    ):
        load = Load(streams, client, probes, target, base_url, prompts, config, Tally())
        first = await load.complete(0)
        if first.error is not None:
            raise SoakError(f"the first request failed: {first.error}")
        idle_before = await idle_cpu(root, config.idle_s)
        start = time.monotonic()
        deadline = start + config.duration_s
        clients = [
            load.client_loop(config.seed * 1000 + i, deadline) for i in range(config.concurrency)
        ]
        samples, *_ = await asyncio.gather(
            sample_loop(load, root, start, deadline), load.ready_loop(deadline), *clients
        )
        kv_after = await settle_kv(load)
        idle_after = await idle_cpu(root, config.idle_s)
    return Measurements(samples, idle_before, idle_after, kv_after, load.tally)


# ---- the verdict ---------------------------------------------------------------------------


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    SKIP = "skip"


class Check(NamedTuple):
    name: str
    status: Status
    detail: str


def _check(name: str, ok: bool, detail: str) -> Check:
    return Check(name, Status.PASS if ok else Status.FAIL, detail)


def growth(before: float, after: float) -> float:
    return after / before - 1.0 if before > 0 else 0.0


def rss_check(samples: Sequence[Sample], warmup_s: float) -> Check:
    name = f"RSS growth < {RSS_GROWTH_LIMIT:.0%} after warm-up"
    first = next((s for s in samples if s.t_s >= warmup_s and s.processes), None)
    last = samples[-1]
    if first is None or first is last:
        return Check(name, Status.SKIP, "no process sample after the warm-up but before the last")
    common = sorted(first.processes.keys() & last.processes.keys())
    pairs = [(first.processes[pid], last.processes[pid]) for pid in common]
    grown = [
        f"{b.label} (pid {b.pid}) {growth(a.rss_bytes, b.rss_bytes):+.1%}"
        for a, b in pairs
        if b.rss_bytes - a.rss_bytes > RSS_NOISE_BYTES
        and growth(a.rss_bytes, b.rss_bytes) >= RSS_GROWTH_LIMIT
    ]
    total = growth(first.rss_bytes, last.rss_bytes)
    worst = max((growth(a.rss_bytes, b.rss_bytes) for a, b in pairs), default=0.0)
    detail = (
        f"total {total:+.1%} ({first.rss_bytes / MIB:.0f} -> {last.rss_bytes / MIB:.0f} MiB, "
        f"t={first.t_s:.0f}..{last.t_s:.0f} s), largest per process {worst:+.1%}"
    )
    if grown:
        detail += "; over the limit: " + ", ".join(grown)
    return _check(name, total < RSS_GROWTH_LIMIT and not grown, detail)


def idle_cpu_check(before: float | None, after: float | None, tolerance_pct: float) -> Check:
    name = "idle CPU back to its start"
    if before is None or after is None:
        return Check(name, Status.SKIP, "no process tree to measure (pass --pid)")
    detail = f"{before:.1f}% before the load, {after:.1f}% after (allowed +{tolerance_pct:g})"
    return _check(name, after <= before + tolerance_pct, detail)


def kv_check(kv_after: dict[str, float] | None) -> Check:
    name = "KV usage 0 after the load"
    if not kv_after:
        return _check(name, False, "no worker reported KV usage at /metrics")
    detail = ", ".join(f"{worker} {value:.1%}" for worker, value in sorted(kv_after.items()))
    return _check(name, not any(kv_after.values()), detail)


def errors_check(tally: Tally) -> Check:
    window = window_of(tally.outcomes)
    ok_ready = tally.ready_probes - tally.ready_failures
    detail = (
        f"{len(tally.outcomes)} requests: {window.completed} complete, {window.disconnected} "
        f"closed early on purpose, {window.errors} errors ({tally.mismatches} greedy mismatches); "
        f"/ready 200 {ok_ready}/{tally.ready_probes}; /metrics failures {tally.metrics_failures}"
    )
    clean = window.errors == tally.ready_failures == tally.metrics_failures == 0
    return _check("no error", clean and window.completed > 0 and tally.ready_probes > 0, detail)


def drift_check(samples: Sequence[Sample], warmup_s: float) -> Check:
    """The least-squares trend of each window's p50 over the windows after warm-up, from the
    first window to the last: one window's p50 moves by several percent on a shared machine,
    a trend through all of them does not."""
    name = f"TTFT and ITL p50 drift < {P50_DRIFT_LIMIT:.0%}"
    windows = [
        s for s in samples if s.window_start_s >= warmup_s and s.window.ttft and s.window.itl
    ]
    if len(windows) < 2:
        return Check(name, Status.SKIP, "fewer than two windows with latencies after warm-up")
    times = [s.t_s for s in windows]
    drifts = []
    for metric in ("ttft", "itl"):
        p50s = [getattr(s.window, metric).p50_ms for s in windows]
        a, b = trend_ends(times, p50s)
        drifts.append((metric.upper(), a, b, growth(a, b)))
    detail = ", ".join(f"{m} {a:.1f} -> {b:.1f} ms ({d:+.1%})" for m, a, b, d in drifts)
    detail += f" (trend over {len(windows)} windows, t={times[0]:.0f}..{times[-1]:.0f} s)"
    return _check(name, all(abs(d) < P50_DRIFT_LIMIT for *_, d in drifts), detail)


def trend_ends(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """The least-squares line through (xs, ys), read at the first and the last x."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return mean_y + slope * (xs[0] - mean_x), mean_y + slope * (xs[-1] - mean_x)


def verdict(config: SoakConfig, measured: Measurements) -> list[Check]:
    return [
        rss_check(measured.samples, config.warmup_s),
        idle_cpu_check(
            measured.idle_before_pct, measured.idle_after_pct, config.idle_cpu_tolerance_pct
        ),
        kv_check(measured.kv_after),
        errors_check(measured.tally),
        drift_check(measured.samples, config.warmup_s),
    ]


def shutdown_check(alive: bool, exit_code: int | None, left: list[str]) -> Check:
    detail = f"server {'ran to the end' if alive else 'died during the soak'}, exit {exit_code}"
    if left:
        detail += "; left running (killed now): " + ", ".join(left)
    return _check("clean shutdown", alive and exit_code == 0 and not left, detail)


# ---- output --------------------------------------------------------------------------------

HEADINGS = ("t s", "procs", "RSS MiB", "CPU %", "KV %", "done", "disc", "err",
            "TTFT p50", "p99", "ITL p50", "p99", "E2E p50", "p99")  # fmt: skip


def format_row(sample: Sample) -> list[str]:
    w = sample.window
    kv = "-" if sample.kv is None else "/".join(f"{sample.kv[k]:.0%}" for k in sorted(sample.kv))
    latencies = [
        f"{value:.1f}" if p else "-" for p in (w.ttft, w.itl, w.e2e) for value in p or ("-", "-")
    ]
    return [
        f"{sample.t_s:.0f}",
        str(len(sample.processes)),
        f"{sample.rss_bytes / MIB:.0f}",
        "-" if sample.cpu_pct is None else f"{sample.cpu_pct:.0f}",
        kv or "-",
        str(w.completed),
        str(w.disconnected),
        str(w.errors),
        *latencies,
    ]


def progress(sample: Sample) -> str:
    w = sample.window
    return (
        f"t={sample.t_s:.0f} s: RSS {sample.rss_bytes / MIB:.0f} MiB, {w.completed} complete, "
        f"{w.disconnected} closed early, {w.errors} errors"
    )


def format_table(samples: Sequence[Sample]) -> str:
    rows = [list(HEADINGS), *(format_row(s) for s in samples)]
    widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    workers = sorted(next((s.kv for s in samples if s.kv), {}))
    legend = f"KV % per worker: {' / '.join(workers) or '-'}; latencies in ms, per window"
    return "\n".join([*lines, legend])


def format_verdict(checks: Sequence[Check]) -> str:
    failed = any(c.status is Status.FAIL for c in checks)
    lines = [f"[{c.status.value:>4}] {c.name}: {c.detail}" for c in checks]
    return "\n".join([*lines, f"verdict: {'FAIL' if failed else 'PASS'}"])


def sample_json(sample: Sample) -> dict:
    w = sample.window
    return {
        "t_s": sample.t_s,
        "window_start_s": sample.window_start_s,
        "rss_mib": sample.rss_bytes / MIB,
        "cpu_pct": sample.cpu_pct,
        "kv_cache_usage": sample.kv,
        "completed": w.completed,
        "disconnected": w.disconnected,
        "errors": w.errors,
        **{
            f"{metric}_{key}": None if p is None else getattr(p, key)
            for metric, p in (("ttft", w.ttft), ("itl", w.itl), ("e2e", w.e2e))
            for key in Percentiles._fields
        },
        "processes": [
            {"pid": p.pid, "label": p.label, "rss_mib": p.rss_bytes / MIB, "cpu_s": p.cpu_s}
            for p in sample.processes.values()
        ],
    }


def report_json(config: SoakConfig, measured: Measurements, checks: Sequence[Check]) -> dict:
    tally = measured.tally
    return {
        "settings": asdict(config),
        "samples": [sample_json(s) for s in measured.samples],
        "idle_cpu_pct": {"before": measured.idle_before_pct, "after": measured.idle_after_pct},
        "kv_after": measured.kv_after,
        "ready": {"probes": tally.ready_probes, "failures": tally.ready_failures},
        "greedy_mismatches": tally.mismatches,
        "messages": [{"message": m, "count": n} for m, n in tally.messages.items()],
        "verdict": {
            "passed": all(c.status is not Status.FAIL for c in checks),
            "checks": [
                {"name": c.name, "status": c.status.value, "detail": c.detail} for c in checks
            ],
        },
    }


# ---- running -------------------------------------------------------------------------------


def run_managed(config: SoakConfig, args: argparse.Namespace) -> tuple[Measurements, Check]:
    """Starts `tandem serve`, soaks it, stops it; the shutdown is checked too."""
    model = ["--model", str(args.model)] if args.model else []
    serve_args = [*SERVE_ARGS, *model, *args.serve_args]
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        log = args.serve_log or Path(tmp) / "serve.log"
        with ServeProcess(serve_args, log) as server:
            print(f"starting tandem serve {' '.join(serve_args)}", file=sys.stderr, flush=True)
            try:
                server.wait_healthy(START_TIMEOUT_S)
                measured = asyncio.run(soak(config, server.url, server.process.pid))
            except ServeError as err:
                raise SoakError(str(err)) from err
            except (SoakError, BenchError) as err:
                raise SoakError(f"{err}\n--- server log ---\n{server.log}") from err
            alive = server.process.poll() is None
            exit_code = server.stop(STOP_TIMEOUT_S)
    seen = {pid: p.label for s in measured.samples for pid, p in s.processes.items()}
    return measured, shutdown_check(alive, exit_code, reap(seen))


def reap(seen: dict[int, str]) -> list[str]:
    """Waits up to EXIT_WAIT_S for the processes seen to be gone; kills, by pid, those that stay
    (only when the pid still runs the same command) and names them."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while (left := still_running(list(seen))) and time.monotonic() < deadline:
        time.sleep(0.25)
    named = []
    for pid in left:
        if _cmdline(pid) == seen[pid]:
            os.kill(pid, signal.SIGKILL)
            named.append(f"{seen[pid]} (pid {pid})")
    return named


def soak_config(args: argparse.Namespace) -> SoakConfig:
    preset = SMOKE if args.smoke else DEFAULTS
    value = {
        key: preset[key] if getattr(args, key) is None else getattr(args, key) for key in preset
    }
    config = SoakConfig(
        duration_s=value["duration"],
        warmup_s=value["warmup"],
        sample_every_s=value["sample_every"],
        idle_s=value["idle"],
        concurrency=value["concurrency"],
        disconnect_fraction=args.disconnect_fraction,
        long_fraction=args.long_fraction,
        request_timeout_s=value["request_timeout"],
        idle_cpu_tolerance_pct=args.idle_cpu_tolerance,
        seed=args.seed,
    )
    positive = (config.duration_s, config.sample_every_s, config.idle_s, config.request_timeout_s)
    if min(positive) <= 0 or config.concurrency < 1 or config.warmup_s < 0:
        raise SoakError("durations must be > 0, --warmup >= 0 and --concurrency >= 1")
    if not (0 <= config.disconnect_fraction <= 1 and 0 <= config.long_fraction <= 1):
        raise SoakError("--disconnect-fraction and --long-fraction must be in [0, 1]")
    return config


def check_target(args: argparse.Namespace) -> None:
    if args.url is None:
        if args.pid is not None:
            raise SoakError("--pid goes with --url; without --url the soak starts its own server")
        return
    if httpx.URL(args.url).host not in ("127.0.0.1", "localhost"):
        raise SoakError(f"--url must be a 127.0.0.1 server, got {args.url}")
    if args.model is not None or args.serve_args:
        raise SoakError("--model and --serve-args start a server; they do not go with --url")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, help="seconds of load (600; --smoke 12)")
    p.add_argument("--warmup", type=float, help="seconds before the verdict's baseline (60; 4)")
    p.add_argument("--sample-every", type=float, help="seconds between samples (15; 4)")
    p.add_argument("--idle", type=float, help="seconds of idle CPU measured before/after (5; 2)")
    p.add_argument("--concurrency", type=int, help="clients in a loop (8; 4)")
    p.add_argument("--request-timeout", type=float, help="seconds per request (120; 60)")
    p.add_argument("--disconnect-fraction", type=float, default=0.1, help="closed early")
    p.add_argument("--long-fraction", type=float, default=0.25, help="share of long prompts")
    p.add_argument("--idle-cpu-tolerance", type=float, default=2.0, help="CPU%% points allowed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="short defaults, about 20 s of load")
    p.add_argument("--json", type=Path, help="write samples and verdict here")
    p.add_argument("--model", type=Path, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--serve-log", type=Path, help="keep the server's output in this file")
    p.add_argument("--url", help="soak this running server instead (127.0.0.1 only)")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for its process tree")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest goes to tandem serve")  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_target(args)
        config = soak_config(args)
        if args.url is None:
            measured, shutdown = run_managed(config, args)
            checks = [*verdict(config, measured), shutdown]
        else:
            measured = asyncio.run(soak(config, args.url.rstrip("/"), args.pid))
            checks = verdict(config, measured)
    except (SoakError, BenchError) as err:
        print(f"soak: {err}", file=sys.stderr)
        return 2
    print(f"\n{format_table(measured.samples)}\n\n{format_verdict(checks)}")
    if measured.tally.messages:
        lines = (f"{n:4d}x {message}" for message, n in measured.tally.messages.items())
        print("errors seen:\n" + "\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report_json(config, measured, checks), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
