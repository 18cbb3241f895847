"""Errors every layer shares: the HTTP front end maps each to one status code."""

from __future__ import annotations


class RequestError(ValueError):
    """A request no worker can take (too long, duplicate id, empty prompt, unknown tokens)."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request alone (its sampling raised); retrying cannot help,
    and every other request goes on."""


class PoolError(ValueError):
    """A pool change this backend cannot make (its pools are fixed, or the size is invalid)."""


class EngineDeadError(RuntimeError):
    """No worker can make progress on the request (its engine stopped, or every retry failed)."""
