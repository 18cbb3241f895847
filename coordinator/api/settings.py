"""ServerSettings: how the HTTP app treats requests. Plain data, no torch, so the command line can
read its defaults cheaply."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_QUEUE = 256


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None  # when set, every route but health/ready/metrics needs it
    max_queue: int = DEFAULT_MAX_QUEUE  # requests admitted but without output yet
    retry_after_s: int = 1  # the Retry-After sent with a 503 for a full queue
    ready_timeout_s: float = 30.0  # how long the readiness probe's generation may take
