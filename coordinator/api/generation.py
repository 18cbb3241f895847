"""One HTTP generation request as a Job: its prompts, the engine requests it fans out to (one per
prompt and choice), and how it runs streamed or to completion.

    Job --plan--> Choice x (prompts * n) --client.generate--> metrics.track --fan_in--> (index, out)

Choice `index` is `prompt * n + j`, as OpenAI numbers them. Choice j of a seeded request draws
with seed + j: choices differ, and choice 0 is what the same request with n=1 returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel

from coordinator.api.context import ServerContext
from coordinator.api.errors import ApiError, invalid
from coordinator.api.prompts import check_prompt_count
from coordinator.api.responses import PromptTokensDetails, Usage
from coordinator.api.sse import EventStream
from coordinator.api.streams import closing, fan_in
from engine.outputs import RequestOutput
from protocol.errors import EngineDeadError
from protocol.sampling import SamplingParams

Outputs = AsyncIterator[tuple[int, RequestOutput]]


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_index: int
    request_id: str  # the engine request's id
    params: SamplingParams


@dataclass(frozen=True)
class Job:
    request_id: str
    created: int
    model: str
    prompts: list[list[int]]
    n: int
    choices: list[Choice]
    arrival: float  # time.monotonic() when the HTTP request came in


def plan_job(
    kind: str,
    ctx: ServerContext,
    prompts: list[list[int]],
    params: list[SamplingParams],
    n: int,
    arrival: float,
) -> Job:
    """`params` has one entry per prompt (their max_tokens may differ). Refuses a request
    that fans out past the server's caps."""
    settings = ctx.settings
    check_prompt_count(len(prompts), settings.max_prompts)
    if n > settings.max_n:
        raise invalid(f"n must be at most {settings.max_n}", param="n")
    request_id = f"{kind}-{uuid.uuid4().hex}"
    single = len(prompts) * n == 1
    choices = []
    for p, prompt_params in enumerate(params):
        for j in range(n):
            index = p * n + j
            engine_id = request_id if single else f"{request_id}-{index}"
            choices.append(Choice(index, p, engine_id, _reseeded(prompt_params, j)))
    return Job(request_id, int(time.time()), ctx.client.model_name, prompts, n, choices, arrival)


def _reseeded(params: SamplingParams, offset: int) -> SamplingParams:
    if params.seed is None or offset == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + offset) % 2**64)


async def run_job(ctx: ServerContext, job: Job, on_output: Callable[[int], None]) -> Outputs:
    """Every choice's outputs as (choice index, output); `on_output(index)` runs at each."""
    streams = [
        ctx.metrics.track(
            ctx.client.generate(job.prompts[c.prompt_index], c.params, c.request_id), job.arrival
        )
        for c in job.choices
    ]
    async with closing(fan_in(streams)) as merged:
        async for index, output in merged:
            if ctx.admission.cut_off:
                raise EngineDeadError("the server is shutting down: its grace period ended")
            on_output(index)
            yield index, output


async def stream_job(
    ctx: ServerContext,
    job: Job,
    render: Callable[[Outputs], AsyncIterator[BaseModel | bytes]],
    wait_first: bool = False,
) -> EventStream:
    """An SSE response for `job`; `render` turns its outputs into chunks (models, or frames
    built already: coordinator/api/sse.py TextFrames). Admission happens
    now (a full queue is a plain 503), the ticket is released when the stream ends.
    `wait_first`: the response starts once the job's first output has come, so a request the
    workers refuse before any output (a response format they cannot compile) gets its error
    status and body, as without streaming, not a 200 whose stream carries the error."""
    ticket = ctx.admission.admit(len(job.choices))
    outputs = run_job(ctx, job, ticket.started)
    if wait_first:
        try:
            first = await anext(outputs)
        except BaseException:  # its error, or the client gone: nothing was sent yet
            await outputs.aclose()
            ticket.release()
            raise
        outputs = _ahead(first, outputs)
    return EventStream(render(outputs), on_close=ticket.release)


async def _ahead(first: tuple[int, RequestOutput], rest: Outputs) -> Outputs:
    async with closing(rest):
        yield first
        async for item in rest:
            yield item


async def complete_job(ctx: ServerContext, job: Job, request: Request) -> dict[int, RequestOutput]:
    """Each choice's final output. If the client disconnects first, the job is cancelled (its
    engine requests aborted, their KV freed) instead of running on for nobody."""
    ticket = ctx.admission.admit(len(job.choices))
    work = asyncio.ensure_future(_final_outputs(run_job(ctx, job, ticket.started)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ApiError(400, "the client disconnected", code="client_disconnected")
        return work.result()
    finally:
        gone.cancel()
        work.cancel()  # no-op once done; else aborts the engine requests
        await asyncio.gather(work, gone, return_exceptions=True)
        ticket.release()


async def _final_outputs(outputs: Outputs) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async with closing(outputs):
        async for index, output in outputs:
            finals[index] = output
    return finals


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next message the server hands us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def choice_usage(job: Job, index: int, out: RequestOutput | None) -> Usage:
    """vLLM's continuous usage, on a chunk of choice `index`: its prompt and its output so far."""
    prompt_tokens = len(job.prompts[job.choices[index].prompt_index])
    completion_tokens = 0 if out is None else len(out.token_ids)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def job_usage(job: Job, latest: dict[int, RequestOutput]) -> Usage:
    """Each prompt counts once, however many choices it has; every choice's output counts."""
    prompt_tokens = sum(len(p) for p in job.prompts)
    completion_tokens = sum(len(out.token_ids) for out in latest.values())
    firsts = [latest.get(c.index) for c in job.choices if c.index % job.n == 0]
    cached = sum(out.num_cached_tokens for out in firsts if out is not None)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
