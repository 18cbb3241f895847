"""POST /v1/completions: text in, text out, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api.context import ServerContext, context_of
from coordinator.api.generation import (
    Job,
    Outputs,
    choice_usage,
    complete_job,
    job_usage,
    plan_job,
    stream_job,
)
from coordinator.api.logprobs import (
    all_logprobs,
    completion_logprobs,
    echoed_logprobs,
    new_logprobs,
    prompt_logprobs,
)
from coordinator.api.prompts import build_params, completion_prompts
from coordinator.api.protocol import CompletionRequest
from coordinator.api.responses import Completion, CompletionChoice, CompletionLogprobs
from coordinator.api.sse import TextFrames
from coordinator.api.streams import closing
from engine.outputs import RequestOutput

router = APIRouter()
NO_LOGPROBS = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    ctx = context_of(request)
    ctx.check_model(body.model)
    prompts = completion_prompts(ctx.client.tokenizer, body.prompt, ctx.settings.max_prompts)
    # max_tokens 0 scores the prompt and generates nothing: the engine makes one token, dropped
    max_tokens = 1 if body.prompt_only else body.max_tokens
    params = [build_params(ctx.client, body, p, max_tokens, body.logprobs, {}) for p in prompts]
    job = plan_job("cmpl", ctx, prompts, params, body.n, arrival)
    echoes = _echoes(ctx, body, prompts)
    if body.stream:
        shown = _prompt_outputs if body.prompt_only else _as_they_are  # (no layer per token)
        return await stream_job(
            ctx,
            job,
            lambda outputs: _chunks(ctx, job, body, shown(outputs), echoes),
            wait_first=body.structure() is not None,
        )
    finals = await complete_job(ctx, job, request)
    if body.prompt_only:
        finals = {index: _prompt_only(out) for index, out in finals.items()}
    choices = [
        _choice(ctx, body, c.index, finals[c.index], echoes[c.prompt_index]) for c in job.choices
    ]
    completion = Completion(
        id=job.request_id,
        created=job.created,
        model=job.model,
        choices=choices,
        usage=job_usage(job, finals),
    )
    return JSONResponse(completion.model_dump())


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """A max_tokens 0 request's output: the token made to get the prompt's logprobs dropped."""
    return out.replace(
        token_ids=[],
        text="",
        delta_token_ids=[],
        delta_text="",
        logprobs=None if out.logprobs is None else [],
        finish_reason="length" if out.finished else None,
        stop_reason=None,
    )


async def _prompt_outputs(outputs: Outputs) -> Outputs:
    async with closing(outputs):
        async for index, out in outputs:
            yield index, _prompt_only(out)


def _as_they_are(outputs: Outputs) -> Outputs:
    return outputs


def _echoes(ctx: ServerContext, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text for `echo` (as sent, or its token ids decoded); "" without echo."""
    if not body.echo:
        return [""] * len(prompts)
    if isinstance(body.prompt, str):
        return [body.prompt]
    if all(isinstance(p, str) for p in body.prompt):
        return list(body.prompt)  # type: ignore[arg-type]
    skip = body.skip_special_tokens  # (as the completion's own text is decoded)
    return [ctx.client.tokenizer.decode(ids, skip_special_tokens=skip) for ids in prompts]


def _choice(
    ctx: ServerContext, body: CompletionRequest, index: int, out: RequestOutput, echo: str
) -> CompletionChoice:
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(ctx.token_texts, *all_logprobs(out), offset=0)
        if body.echoed_logprobs is not None and out.prompt_logprobs is not None:
            logprobs = _with_prompt(ctx, body, out, logprobs)
    return CompletionChoice(
        index=index,
        text=echo + out.text,
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        prompt_logprobs=prompt_logprobs(ctx.token_texts, out, body.prompt_logprobs),
    )


def _with_prompt(
    ctx: ServerContext,
    body: CompletionRequest,
    out: RequestOutput,
    completion: CompletionLogprobs,
) -> CompletionLogprobs:
    """echo with logprobs: the prompt's tokens' logprobs before the completion's."""
    texts, prompt = ctx.token_texts, out.prompt_token_ids
    return echoed_logprobs(texts, prompt, out.prompt_logprobs, body.logprobs, completion)


async def _chunks(
    ctx: ServerContext, job: Job, body: CompletionRequest, outputs: Outputs, echoes: list[str]
) -> AsyncIterator[Completion | bytes]:
    latest: dict[int, RequestOutput] = {}
    continuous = body.continuous_usage  # every chunk with its choice's usage so far

    def chunk(choice: CompletionChoice) -> Completion:
        usage = choice_usage(job, choice.index, latest.get(choice.index)) if continuous else None
        return Completion(
            id=job.request_id, created=job.created, model=job.model, choices=[choice], usage=usage
        )

    def text_chunk(index: int, text: str) -> Completion:
        return chunk(CompletionChoice(index=index, text=text))

    offsets: dict[int, int] = {}  # text characters sent per choice, for logprobs' text_offset
    plain = TextFrames(text_chunk)  # chunks of text alone, framed fast
    # echo: each choice opens with its prompt's text; with logprobs, once the first output
    # brings the prompt's
    echo_of = {c.index: echoes[c.prompt_index] for c in job.choices}
    scored_echo = body.echoed_logprobs is not None
    for c in job.choices:
        if echo_of[c.index] and not scored_echo:
            yield (
                text_chunk(c.index, echo_of[c.index])
                if continuous
                else plain.frame(c.index, echo_of[c.index])
            )
    async for index, out in outputs:
        latest[index] = out
        if scored_echo and index not in offsets and out.prompt_logprobs is not None:
            opening = _with_prompt(ctx, body, out, NO_LOGPROBS)
            yield chunk(CompletionChoice(index=index, text=echo_of[index], logprobs=opening))
            offsets[index] = sum(len(token) for token in opening.tokens)
        logprobs: CompletionLogprobs | None = None
        if body.logprobs is not None and out.delta_token_ids:
            offset = offsets.get(index, 0)
            logprobs = completion_logprobs(ctx.token_texts, *new_logprobs(out), offset=offset)
            offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
        if not (out.delta_text or out.finished or logprobs):
            continue  # text held back (a stop string may be starting): nothing to say yet
        if logprobs is None and not out.finished and not continuous:  # the common chunk
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
