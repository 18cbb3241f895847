"""Tool calls parsed out of chat replies (`--enable-auto-tool-choice --tool-call-parser hermes`):
the parser alone, fed in every split, and through the HTTP API with a backend whose replies are
scripted (a random-weight model writes no tool calls)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from coordinator.api.settings import ServerSettings
from coordinator.api.tool_calls import HermesParser, split_reply
from engine.outputs import RequestOutput
from protocol.sampling import SamplingParams
from tests.support.servers import local_client
from tests.support.wrapped_clients import WrappedClient

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
REPLY = "Let me check. " + CALL + CALL.replace("Oslo", "Bergen")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def test_a_whole_reply_splits_into_text_and_calls() -> None:
    text, calls = split_reply(REPLY)
    assert text == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})
    ]  # fmt: skip
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_fed_in_pieces_it_gives_what_the_whole_reply_gives(size: int) -> None:
    parser = HermesParser()
    text, names = "", []
    for start in range(0, len(REPLY), size):
        piece, calls = parser.feed(REPLY[start : start + size])
        text += piece
        names += [json.loads(c.arguments)["city"] for c in calls]
        assert "<" not in piece  # nothing of a tag ever goes out as text
    tail, last = parser.finish()
    assert (text + tail, names + [c.name for c in last]) == ("Let me check. ", ["Oslo", "Bergen"])


def test_what_is_not_a_call_stays_text() -> None:
    for reply in ("a < b and <tool_ca", "<tool_call>not json</tool_call> ok",
                  '<tool_call>{"city": 1}</tool_call>', "plain"):  # fmt: skip
        text, calls = split_reply(reply)
        assert (text, calls) == (reply, [])


def test_calls_no_response_could_carry_stay_text() -> None:
    # Nested past the JSON parser's depth (was a RecursionError: a 500, or an error mid-stream),
    # a lone surrogate in the name or arguments (the response could not be encoded), NaN and
    # an infinite number (their arguments would not be JSON).
    deep = '{"name": "f", "arguments": ' + "[" * 1100 + "]" * 1100 + "}"
    surrogates = [
        '{"name": "\\ud800", "arguments": {}}',
        '{"name": "f", "arguments": {"x": "\\udfff"}}',
    ]
    numbers = ['{"name": "f", "arguments": {"x": NaN}}', '{"name": "f", "arguments": {"x": 1e999}}']
    for body in [deep, *surrogates, *numbers]:
        reply = f"<tool_call>{body}</tool_call>"
        assert split_reply(reply) == (reply, [])


def test_an_unclosed_call_at_the_end_still_counts() -> None:
    text, calls = split_reply('Sure. <tool_call>{"name": "f", "arguments": {}}')
    assert text == "Sure. " and [(c.name, c.arguments) for c in calls] == [("f", "{}")]


class ScriptedReplies(WrappedClient):
    """Every request's reply is REPLY, a few characters an output, then "stop"."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        pieces = [REPLY[i : i + 7] for i in range(0, len(REPLY), 7)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput(
                request_id, prompt_ids, token_ids=list(range(k + 1)),
                text="".join(pieces[: k + 1]), delta_token_ids=[k], delta_text=piece,
                finish_reason="stop" if last else None,
            )  # fmt: skip


@pytest.fixture(scope="module")
def server(serve, tiny_llama):
    settings = ServerSettings(tool_call_parser="hermes")
    return serve(ScriptedReplies(local_client(tiny_llama)), settings)


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


MESSAGES = [{"role": "user", "content": "Weather in Oslo and Bergen?"}]


def test_a_reply_with_calls_comes_back_as_tool_calls(api) -> None:
    got = api.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER])
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)["city"]) for c in calls] == [
        ("get_weather", "Oslo"), ("get_weather", "Bergen")
    ]  # fmt: skip
    # The conversation goes on with the calls and their results, as an agent sends it.
    follow = [*MESSAGES, choice.message.model_dump(), *(
        {"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls)]  # fmt: skip
    again = api.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER])
    assert again.choices[0].finish_reason == "tool_calls"


def test_streamed_calls_arrive_whole_after_the_text(api) -> None:
    stream = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], stream=True
    )
    text, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert text == "Let me check. " and finish == "tool_calls"
    assert [c.index for c in calls] == [0, 1]
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Oslo", "Bergen"]


def test_without_tools_or_with_choice_none_the_reply_stays_text(api) -> None:
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        got = api.chat.completions.create(model="tiny", messages=MESSAGES, **extra)
        assert got.choices[0].message.content == REPLY
        assert got.choices[0].finish_reason == "stop" and not got.choices[0].message.tool_calls


def test_auto_needs_a_parser(serve, tiny_llama) -> None:
    plain = serve(local_client(tiny_llama))
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2}
    response = httpx.post(plain.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]
