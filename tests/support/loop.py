"""An asyncio loop in a background thread, so sync tests can drive async backends that outlive
one test (the coordinator's poll tasks live on the loop that started them)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine, timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


async def collect(client, prompt_ids: list[int], params, request_id: str):
    """The final RequestOutput of one request, and how many outputs were streamed."""
    final, count = None, 0
    async for output in client.generate(prompt_ids, params, request_id):
        final, count = output, count + 1
    return final, count
