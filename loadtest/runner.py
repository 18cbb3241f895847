"""Running the load: a probe request, warm-ups, then every sample sent at its arrival time, at most
`max_concurrency` in flight, the whole run cut at `max_duration_s`."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from loadtest.arrivals import send_offsets
from loadtest.client import RequestResult, build_payload, send_request, stream_client
from loadtest.config import LoadConfig, SamplingConfig
from loadtest.errors import BenchError
from loadtest.sample import SampleRequest
from loadtest.target import Target

PROBE_MAX_TOKENS = 16


@dataclass(frozen=True)
class RunOutcome:
    results: tuple[RequestResult, ...]  # requests that finished or failed, in sample order
    started_at: float  # perf_counter when the first measured request was due
    duration_s: float
    num_aborted: int  # in flight when max_duration_s ran out
    num_unsent: int  # never sent because max_duration_s ran out


class _Phase(enum.Enum):
    WAITING = "waiting"
    SENT = "sent"


async def run_load(
    target: Target,
    samples: list[SampleRequest],
    sampling: SamplingConfig,
    load: LoadConfig,
    request_timeout_s: float,
    show_progress: bool,
) -> RunOutcome:
    async with stream_client(load.max_concurrency) as client:
        sender = _Sender(client, target, sampling, request_timeout_s)
        await sender.probe(samples[0])
        await sender.warm_up(samples, load)
        return await _measure(sender, samples, load, show_progress)


@dataclass(frozen=True)
class _Sender:
    client: aiohttp.ClientSession
    target: Target
    sampling: SamplingConfig
    timeout_s: float

    async def send(self, sample: SampleRequest) -> RequestResult:
        payload = build_payload(self.target, sample, self.sampling)
        return await send_request(
            self.client, self.target, payload, sample.prompt_len, self.timeout_s
        )

    async def probe(self, sample: SampleRequest) -> None:
        """One short request first, so a wrong URL, model or endpoint fails with one message."""
        short = sample._replace(
            expected_output_len=min(sample.expected_output_len, PROBE_MAX_TOKENS)
        )
        result = await self.send(short)
        if not result.success:
            raise BenchError(f"the first request to {self.target.url} failed: {result.error}")

    async def warm_up(self, samples: list[SampleRequest], load: LoadConfig) -> None:
        gate = asyncio.Semaphore(load.max_concurrency or max(load.num_warmups, 1))

        async def one(sample: SampleRequest) -> RequestResult:
            async with gate:
                return await self.send(sample)

        # The first request each time, as vllm bench serve warms up: distinct ones would put the
        # first measured prompts in a prefix cache and shorten their TTFT.
        warmups = [samples[0]] * load.num_warmups
        for result in await asyncio.gather(*(one(sample) for sample in warmups)):
            if not result.success:
                raise BenchError(f"a warm-up request failed: {result.error}")


async def _measure(
    sender: _Sender, samples: list[SampleRequest], load: LoadConfig, show_progress: bool
) -> RunOutcome:
    offsets = send_offsets(len(samples), load.request_rate, load.burstiness, load.seed)
    gate = asyncio.Semaphore(load.max_concurrency or len(samples))
    phases = [_Phase.WAITING] * len(samples)
    bar = tqdm(total=len(samples), disable=not show_progress, unit="req")
    started_at = time.perf_counter()

    async def one(index: int) -> RequestResult:
        due = started_at + offsets[index]
        # uvloop's timers count whole milliseconds and may fire up to one early: sleep again.
        while (wait := due - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        async with gate:
            phases[index] = _Phase.SENT
            result = await sender.send(samples[index])
        bar.update(1)
        return result

    tasks = [asyncio.create_task(one(i)) for i in range(len(samples))]
    _, pending = await asyncio.wait(tasks, timeout=load.max_duration_s)
    if load.max_duration_s is not None:  # (uvloop's timer may fire a millisecond early)
        end = started_at + load.max_duration_s
        while pending and (left := end - time.perf_counter()) > 0:
            _, pending = await asyncio.wait(pending, timeout=left)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)  # cancelled tasks end promptly
    duration_s = time.perf_counter() - started_at
    bar.close()
    cut = [phases[i] for i, task in enumerate(tasks) if task in pending]
    return RunOutcome(
        results=tuple(task.result() for task in tasks if task not in pending),
        started_at=started_at,
        duration_s=duration_s,
        num_aborted=cut.count(_Phase.SENT),
        num_unsent=cut.count(_Phase.WAITING),
    )
