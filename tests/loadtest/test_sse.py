"""Parsing stream lines of both OpenAI response shapes."""

from __future__ import annotations

import json

from loadtest.sse import StreamEvent, parse_sse_line


def data(chunk: object) -> str:
    return "data: " + json.dumps(chunk)


def test_completion_text() -> None:
    event = parse_sse_line(data({"choices": [{"index": 0, "text": "Hello"}]}))
    assert event == StreamEvent("Hello", None, None, None, False, timed=True)


def test_chat_delta_content_and_role_only_chunk() -> None:
    assert parse_sse_line(data({"choices": [{"delta": {"content": "Hi"}}]})).text == "Hi"
    role_only = parse_sse_line(data({"choices": [{"delta": {"role": "assistant"}}]}))
    assert role_only == StreamEvent("", None, None, None, False, timed=False)


def test_a_chunk_with_a_choice_is_timed_even_with_no_text() -> None:
    """vLLM's client times every chunk with a choice: a special token skipped from the text,
    the final chunk with finish_reason (tandem's and vLLM's servers send one when the model
    stops on EOS). Left untimed, E2EL lost that last step and TPOT read low."""
    final = parse_sse_line(data({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}))
    assert final.timed and final.text == ""
    chat_final = {"choices": [{"delta": {}, "finish_reason": "stop"}]}
    assert parse_sse_line(data(chat_final)).timed
    assert not parse_sse_line(data({"choices": [], "usage": {"completion_tokens": 3}})).timed


def test_usage_chunk_carries_the_token_counts() -> None:
    usage = {"completion_tokens": 17, "prompt_tokens": 158}
    event = parse_sse_line(data({"choices": [], "usage": usage}))
    assert event == StreamEvent("", 17, 158, None, False, timed=False)


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
    # a plain chunk that names the field as null is no error
    fine = parse_sse_line(data({"choices": [{"text": "ab"}], "error": None}))
    assert fine.error is None and fine.text == "ab"
