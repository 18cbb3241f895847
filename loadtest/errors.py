"""The one error type `tandem bench` raises for failures the user can act on, and helpers that keep
its messages to one readable line."""

from __future__ import annotations

import json

MESSAGE_LIMIT = 200


class BenchError(RuntimeError):
    """An expected failure of a benchmark; the message is one line, printed as is."""


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` with its whitespace collapsed, cut to `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def describe_http_error(status: int, reason: str, body: str) -> str:
    """'HTTP 404 Not Found: <the server's message>', reading OpenAI / FastAPI error bodies."""
    message = _server_message(body)
    head = f"HTTP {status} {reason}".rstrip()
    return f"{head}: {one_line(message)}" if message else head


def _server_message(body: str) -> str:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()
    if not isinstance(parsed, dict):
        return body.strip()
    error = parsed.get("error")
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    for key in ("message", "detail", "error"):
        if key in parsed:
            return str(parsed[key])
    return body.strip()
