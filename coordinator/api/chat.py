"""POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api.context import ServerContext, context_of
from coordinator.api.errors import invalid
from coordinator.api.generation import (
    Job,
    Outputs,
    choice_usage,
    complete_job,
    job_usage,
    plan_job,
    stream_job,
)
from coordinator.api.logprobs import all_logprobs, chat_logprobs, new_logprobs, prompt_logprobs
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
    DeltaToolCall,
    FunctionOut,
    ToolCallOut,
    ToolCallsDelta,
    Usage,
)
from coordinator.api.sse import TextFrames
from coordinator.api.tool_calls import HermesParser, ParsedCall, new_call_id, split_reply
from engine.outputs import RequestOutput

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    ctx = context_of(request)
    ctx.check_model(body.model)
    if body.effective_tool_choice == "auto" and ctx.settings.tool_call_parser is None:
        raise invalid(
            'tool_choice "auto" (the default with tools) needs a server started with '
            '--enable-auto-tool-choice --tool-call-parser hermes; or send tool_choice "none" '
            "(the tools still reach the model through its chat template)",
            param="tool_choice",
        )
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
        render = functools.partial(_chunks, ctx, job, body)
        return await stream_job(ctx, job, render, wait_first=body.structure() is not None)
    finals = await complete_job(ctx, job, request)
    choices = [_choice(ctx, body, c.index, finals[c.index]) for c in job.choices]
    scored = finals[job.choices[0].index]  # (every choice has the one prompt)
    completion = ChatCompletion(
        id=job.request_id,
        created=job.created,
        model=job.model,
        choices=choices,
        usage=job_usage(job, finals),
        prompt_logprobs=prompt_logprobs(ctx.token_texts, scored, body.prompt_logprobs),
    )
    return JSONResponse(completion.model_dump())


def _choice(
    ctx: ServerContext, body: ChatCompletionRequest, index: int, out: RequestOutput
) -> ChatChoice:
    logprobs = chat_logprobs(ctx.token_texts, *all_logprobs(out)) if body.logprobs else None
    content: str | None = out.text
    calls: list[ParsedCall] = []
    finish_reason = out.finish_reason
    if body.forces_calls:  # the whole reply is the calls
        content, calls, finish_reason = _forced_calls(body, out)
    elif _parses_tools(ctx, body):
        content, calls = split_reply(out.text)
        finish_reason = "tool_calls" if calls else finish_reason
    return ChatChoice(
        index=index,
        message=AssistantMessage(
            content=content if content or not calls else None,
            tool_calls=[_call_out(call) for call in calls],
        ),
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=out.stop_reason,
    )


def _parses_tools(ctx: ServerContext, body: ChatCompletionRequest) -> bool:
    return body.effective_tool_choice == "auto" and ctx.settings.tool_call_parser is not None


def _forced_calls(
    body: ChatCompletionRequest, out: RequestOutput
) -> tuple[str | None, list[ParsedCall], str | None]:
    """(content, calls, finish_reason) of a reply the request held to tool calls.

    A named tool_choice: the reply is the call's arguments, held to the function's parameters
    (OpenAI's finish_reason is then "stop": the caller chose the call). "required": the reply
    is a JSON array of {"name", "parameters"} (ChatCompletionRequest._calls_schema), and the
    finish_reason "tool_calls"; a reply cut short (max_tokens) is no array and stays text."""
    tool = body.forced_tool
    if tool is not None:
        return None, [ParsedCall(new_call_id(), tool.function.name, out.text)], out.finish_reason
    try:
        items = json.loads(out.text)
        calls = [
            ParsedCall(
                new_call_id(), item["name"], json.dumps(item["parameters"], ensure_ascii=False)
            )
            for item in items
        ]
    except (ValueError, TypeError, KeyError):
        return out.text, [], out.finish_reason
    return None, calls, "tool_calls"


def _call_out(call: ParsedCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionOut(name=call.name, arguments=call.arguments))


def _tool_call_choice(
    index: int,
    calls: list[ParsedCall],
    first: int,
    out: RequestOutput,
    finish_reason: str = "tool_calls",
    logprobs: ChatLogprobs | None = None,
) -> ChatChunkChoice:
    """A chunk choice carrying complete calls; `first`: the first one's place in the reply;
    `finish_reason`: the choice's, if these are its last."""
    delta = ToolCallsDelta(
        tool_calls=[
            DeltaToolCall(
                index=first + k,
                id=call.id,
                function=FunctionOut(name=call.name, arguments=call.arguments),
            )
            for k, call in enumerate(calls)
        ]
    )
    return ChatChunkChoice(
        index=index,
        delta=delta,
        logprobs=logprobs,
        finish_reason=finish_reason if out.finished else None,
        stop_reason=out.stop_reason if out.finished else None,
    )


async def _chunks(
    ctx: ServerContext, job: Job, body: ChatCompletionRequest, outputs: Outputs
) -> AsyncIterator[ChatCompletionChunk | bytes]:
    latest: dict[int, RequestOutput] = {}
    continuous = body.continuous_usage  # every chunk with its choice's usage so far

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        if continuous and usage is None:
            usage = choice_usage(job, choices[0].index, latest.get(choices[0].index))
        return ChatCompletionChunk(
            id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
        )

    # OpenAI opens every choice with a role-only delta.
    for c in job.choices:
        yield chunk([ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content=""))])

    def text_chunk(index: int, text: str) -> ChatCompletionChunk:
        return chunk([ChatChunkChoice(index=index, delta=Delta(content=text))])

    plain = TextFrames(text_chunk)  # chunks of text alone, framed fast
    # Each choice's tool-call parser, when the reply may hold calls: text goes on as it comes,
    # a call once its closing tag has come (coordinator/api/tool_calls.py).
    parsers = {c.index: HermesParser() for c in job.choices} if _parses_tools(ctx, body) else {}
    forced = body.forces_calls
    async for index, out in outputs:
        latest[index] = out
        if forced:  # the calls go whole, once the reply is complete
            if out.finished:
                content, calls, finish_reason = _forced_calls(body, out)
                every = None  # every token's logprobs in the one chunk: the reply goes whole
                if body.logprobs:
                    every = chat_logprobs(ctx.token_texts, *all_logprobs(out))
                if content is not None:  # no calls after all (cut short): the text
                    choice = ChatChunkChoice(
                        index=index,
                        delta=Delta(content=content),
                        logprobs=every,
                        finish_reason=finish_reason,
                        stop_reason=out.stop_reason,
                    )
                    yield chunk([choice])
                else:
                    yield chunk([_tool_call_choice(index, calls, 0, out, finish_reason, every)])
            continue
        text, calls = out.delta_text, []
        parser = parsers.get(index)
        if parser is not None:
            text, calls = parser.feed(text)
            if out.finished:
                tail, last = parser.finish()
                text, calls = text + tail, calls + last
        logprobs: ChatLogprobs | None = None
        if body.logprobs and out.delta_token_ids:
            logprobs = chat_logprobs(ctx.token_texts, *new_logprobs(out))
        if calls and parser is not None:
            if text or logprobs:  # the text before the calls goes first
                yield chunk(
                    [ChatChunkChoice(index=index, delta=Delta(content=text), logprobs=logprobs)]
                )
                text, logprobs = "", None
            yield chunk([_tool_call_choice(index, calls, len(parser.calls) - len(calls), out)])
            if out.finished:
                continue
        if not (text or out.finished or logprobs):
            continue  # text held back (a stop string or a tool call may be starting)
        if logprobs is None and not out.finished and not continuous:  # the common chunk
            yield plain.frame(index, text)
            continue
        finish_reason = out.finish_reason
        if out.finished and parser is not None and parser.calls:
            finish_reason = "tool_calls"
        choice = ChatChunkChoice(
            index=index,
            delta=Delta(content=text),
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=out.stop_reason,
        )
        yield chunk([choice])
    if body.include_usage:
        yield chunk([], usage=job_usage(job, latest))
