"""Parsing stream lines of both OpenAI response shapes."""

from __future__ import annotations

import json

from loadtest.sse import StreamEvent, parse_sse_line


def data(chunk: object) -> str:
    return "data: " + json.dumps(chunk)


def test_completion_text() -> None:
    event = parse_sse_line(data({"choices": [{"index": 0, "text": "Hello"}]}))
    assert event == StreamEvent("Hello", None, None, None, False)


def test_chat_delta_content_and_role_only_chunk() -> None:
    assert parse_sse_line(data({"choices": [{"delta": {"content": "Hi"}}]})).text == "Hi"
    role_only = parse_sse_line(data({"choices": [{"delta": {"role": "assistant"}}]}))
    assert role_only == StreamEvent("", None, None, None, False)


def test_usage_chunk_carries_the_token_counts() -> None:
    usage = {"completion_tokens": 17, "prompt_tokens": 158}
    event = parse_sse_line(data({"choices": [], "usage": usage}))
    assert event == StreamEvent("", 17, 158, None, False)


def test_done_and_ignored_lines() -> None:
    assert parse_sse_line("data: [DONE]") == StreamEvent("", None, None, None, True)
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("event: message") is None


def test_errors_inside_the_stream() -> None:
    event = parse_sse_line(data({"object": "error", "message": "out of memory"}))
    assert event.error == "error in the stream: out of memory"
    event = parse_sse_line(data({"error": {"message": "bad", "code": 400}}))
    assert event.error == "error in the stream: bad"
    assert parse_sse_line("data: {not json").error.startswith("invalid JSON in the stream")
