"""The event loop the load tester's clients run on: uvloop where it is installed (tandem
installs it, except on Windows), else asyncio's own.

A client shares the machine with the server it measures, so every microsecond it spends per
token is one the server under test does not get. uvloop's loop takes about a quarter less of
the client's CPU per streamed token than asyncio's (docs/performance.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop
except ImportError:  # pragma: no cover - Windows, or a slimmed install
    uvloop = None


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the fastest loop available."""
    if uvloop is None:
        return asyncio.run(main)
    return uvloop.run(main)
