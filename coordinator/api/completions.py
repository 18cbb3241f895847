"""POST /v1/completions: text in, text out, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api.context import ServerContext, context_of
from coordinator.api.generation import Job, Outputs, complete_job, job_usage, plan_job, stream_job
from coordinator.api.logprobs import all_logprobs, completion_logprobs, new_logprobs
from coordinator.api.prompts import build_params, completion_prompts
from coordinator.api.protocol import CompletionRequest
from coordinator.api.responses import Completion, CompletionChoice, CompletionLogprobs
from coordinator.api.sse import TextFrames
from engine.outputs import RequestOutput

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    ctx = context_of(request)
    ctx.check_model(body.model)
    prompts = completion_prompts(ctx.client.tokenizer, body.prompt)
    params = [
        build_params(ctx.client, body, p, body.max_tokens, body.logprobs, {}) for p in prompts
    ]
    job = plan_job("cmpl", ctx, prompts, params, body.n, arrival)
    if body.stream:
        return stream_job(ctx, job, lambda outputs: _chunks(ctx, job, body, outputs))
    finals = await complete_job(ctx, job, request)
    choices = [_choice(ctx, body, c.index, finals[c.index]) for c in job.choices]
    completion = Completion(
        id=job.request_id,
        created=job.created,
        model=job.model,
        choices=choices,
        usage=job_usage(job, finals),
    )
    return JSONResponse(completion.model_dump())


def _choice(
    ctx: ServerContext, body: CompletionRequest, index: int, out: RequestOutput
) -> CompletionChoice:
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(ctx.token_texts, *all_logprobs(out), offset=0)
    return CompletionChoice(
        index=index,
        text=out.text,
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )


async def _chunks(
    ctx: ServerContext, job: Job, body: CompletionRequest, outputs: Outputs
) -> AsyncIterator[Completion | bytes]:
    def chunk(choice: CompletionChoice) -> Completion:
        return Completion(id=job.request_id, created=job.created, model=job.model, choices=[choice])

    def text_chunk(index: int, text: str) -> Completion:
        return chunk(CompletionChoice(index=index, text=text))

    latest: dict[int, RequestOutput] = {}
    offsets: dict[int, int] = {}  # text characters sent per choice, for logprobs' text_offset
    plain = TextFrames(text_chunk)  # chunks of text alone, framed fast
    async for index, out in outputs:
        latest[index] = out
        logprobs: CompletionLogprobs | None = None
        if body.logprobs is not None and out.delta_token_ids:
            offset = offsets.get(index, 0)
            logprobs = completion_logprobs(ctx.token_texts, *new_logprobs(out), offset=offset)
            offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
        if not (out.delta_text or out.finished or logprobs):
            continue  # text held back (a stop string may be starting): nothing to say yet
        if logprobs is None and not out.finished:  # the common chunk: text alone
            yield plain.frame(index, out.delta_text)
            continue
        choice = CompletionChoice(
            index=index,
            text=out.delta_text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        yield chunk(choice)
    if body.include_usage:
        yield Completion(
            id=job.request_id,
            created=job.created,
            model=job.model,
            choices=[],
            usage=job_usage(job, latest),
        )
