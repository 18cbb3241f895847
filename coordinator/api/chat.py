"""POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api.context import ServerContext, context_of
from coordinator.api.generation import Job, Outputs, complete_job, job_usage, plan_job, stream_job
from coordinator.api.logprobs import all_logprobs, chat_logprobs, new_logprobs
from coordinator.api.prompts import build_params, chat_prompt
from coordinator.api.protocol import ChatCompletionRequest
from coordinator.api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Delta,
    Usage,
)
from coordinator.api.sse import TextFrames
from engine.outputs import RequestOutput

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    ctx = context_of(request)
    ctx.check_model(body.model)
    prompt = chat_prompt(ctx.client.tokenizer, body.messages, **body.template_options())
    names = {
        "prompt": "messages",
        "logprobs": "top_logprobs",
        "max_tokens": (
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ),
    }
    params = build_params(
        ctx.client, body, prompt, body.requested_max_tokens, body.num_logprobs, names
    )
    job = plan_job("chatcmpl", ctx, [prompt], [params], body.n, arrival)
    if body.stream:
        return stream_job(ctx, job, lambda outputs: _chunks(ctx, job, body, outputs))
    finals = await complete_job(ctx, job, request)
    choices = [_choice(ctx, body, c.index, finals[c.index]) for c in job.choices]
    completion = ChatCompletion(
        id=job.request_id,
        created=job.created,
        model=job.model,
        choices=choices,
        usage=job_usage(job, finals),
    )
    return JSONResponse(completion.model_dump())


def _choice(
    ctx: ServerContext, body: ChatCompletionRequest, index: int, out: RequestOutput
) -> ChatChoice:
    logprobs = chat_logprobs(ctx.token_texts, *all_logprobs(out)) if body.logprobs else None
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=out.text),
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )


async def _chunks(
    ctx: ServerContext, job: Job, body: ChatCompletionRequest, outputs: Outputs
) -> AsyncIterator[ChatCompletionChunk | bytes]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
        )

    # OpenAI opens every choice with a role-only delta.
    for c in job.choices:
        yield chunk([ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content=""))])

    def text_chunk(index: int, text: str) -> ChatCompletionChunk:
        return chunk([ChatChunkChoice(index=index, delta=Delta(content=text))])

    latest: dict[int, RequestOutput] = {}
    plain = TextFrames(text_chunk)  # chunks of text alone, framed fast
    async for index, out in outputs:
        latest[index] = out
        logprobs: ChatLogprobs | None = None
        if body.logprobs and out.delta_token_ids:
            logprobs = chat_logprobs(ctx.token_texts, *new_logprobs(out))
        if not (out.delta_text or out.finished or logprobs):
            continue  # text held back (a stop string may be starting): nothing to say yet
        if logprobs is None and not out.finished:  # the common chunk: text alone
            yield plain.frame(index, out.delta_text)
            continue
        choice = ChatChunkChoice(
            index=index,
            delta=Delta(content=out.delta_text),
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        yield chunk([choice])
    if body.include_usage:
        yield chunk([], usage=job_usage(job, latest))
