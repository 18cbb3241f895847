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
    # A choice's output arrived, timed as vLLM's client times it: every chunk with a choice, its
    # text empty or not (a special token skipped, the last chunk with finish_reason), except a
    # chat role-only opening delta, which carries nothing generated.
    timed: bool = False


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
    if chunk.get("error") is not None or chunk.get("object") == "error":  # ("error": null is none)
        return StreamEvent("", None, None, f"error in the stream: {_error_text(chunk)}", False)
    text, timed = _choice_text(chunk)
    return StreamEvent(
        text, _usage(chunk, "completion_tokens"), _usage(chunk, "prompt_tokens"), None, False,
        timed,
    )  # fmt: skip


def _choice_text(chunk: dict) -> tuple[str, bool]:
    """The first choice's text, and whether the chunk is timed (StreamEvent.timed)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "", False
    choice = choices[0]
    delta = choice.get("delta")
    if "text" in choice:
        text = choice["text"]
    else:
        text = delta.get("content") if isinstance(delta, dict) else None
    text = text if isinstance(text, str) else ""
    opening = isinstance(delta, dict) and "role" in delta and not text
    return text, not opening or choice.get("finish_reason") is not None


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
