"""ServerSettings: how the HTTP app treats requests. Plain data, no torch, so the command line can
read its defaults cheaply."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_QUEUE = 256
TOOL_CALL_PARSERS = ("hermes",)  # coordinator/api/tool_calls.py
MAX_N = 16  # choices per request by default; each is a separate engine request


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None  # when set, every route but health/ready/metrics needs it
    max_queue: int = DEFAULT_MAX_QUEUE  # sequences admitted but without output yet
    max_prompts: int = 64  # prompts in one completions request (a list of prompts)
    max_n: int = MAX_N  # choices per prompt
    max_body_bytes: int = 8 * 2**20  # request bodies over this get 413
    retry_after_s: int = 1  # the Retry-After sent with a 503 for a full queue
    # Browser origins allowed to call the API (CORS); "*" any, as vLLM's default; () none.
    allowed_origins: tuple[str, ...] = ("*",)
    # Parses tool calls out of chat replies (coordinator/api/tool_calls.py), which lets
    # requests with tools use tool_choice "auto"; None: no parsing, only tool_choice "none".
    tool_call_parser: str | None = None
