"""Reading one line of an OpenAI-compatible server-sent-event stream, for both the completions
(`choices[0].text`) and the chat (`choices[0].delta.content`) shapes."""

from __future__ import annotations

import json
from typing import NamedTuple

from loadtest.errors import one_line

DONE = "[DONE]"


class StreamEvent(NamedTuple):
    text: str  # generated text carried by this chunk; "" for role-only, usage or final chunks
    completion_tokens: int | None  # from a `usage` object, when the chunk has one
    prompt_tokens: int | None  # the same
    error: str | None  # the server reported an error inside the stream
    done: bool  # the `data: [DONE]` terminator


def parse_sse_line(line: str) -> StreamEvent | None:
    """The event of a `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == DONE:
        return StreamEvent("", None, None, None, True)
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return StreamEvent(
            "", None, None, f"invalid JSON in the stream: {one_line(data, 80)}", False
        )
    if not isinstance(chunk, dict):
        return StreamEvent(
            "", None, None, f"unexpected chunk in the stream: {one_line(data, 80)}", False
        )
    if "error" in chunk or chunk.get("object") == "error":
        return StreamEvent("", None, None, f"error in the stream: {_error_text(chunk)}", False)
    return StreamEvent(
        _choice_text(chunk), _usage(chunk, "completion_tokens"), _usage(chunk, "prompt_tokens"),
        None, False,
    )  # fmt: skip


def _choice_text(chunk: dict) -> str:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if "text" in choice:
        text = choice["text"]
    else:
        text = delta.get("content") if isinstance(delta, dict) else None
    return text if isinstance(text, str) else ""


def _usage(chunk: dict, field: str) -> int | None:
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get(field), int):
        return usage[field]
    return None


def _error_text(chunk: dict) -> str:
    error = chunk.get("error")
    if isinstance(error, dict):
        return one_line(str(error.get("message", error)))
    return one_line(str(error if error is not None else chunk.get("message", chunk)))
