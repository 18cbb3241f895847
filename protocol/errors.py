"""Errors every layer shares: the HTTP front end maps each to one status code."""

from __future__ import annotations


class RequestError(ValueError):
    """A request no worker can take (too long, duplicate id, empty prompt, unknown tokens)."""


class InvalidOutputError(RequestError):
    """A worker refused what the request asks of its output (a response format its grammar
    compiler cannot take): the client's error, found only where the output is made."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request alone (its sampling raised); retrying cannot help,
    and every other request goes on."""


class PoolError(ValueError):
    """A pool change this backend cannot make (its pools are fixed, or the size is invalid)."""


class RoleSwitchError(RuntimeError):
    """A worker's role switch failed on the worker (it is retired and replaced): the pools are
    not as asked."""


class EngineDeadError(RuntimeError):
    """No worker can make progress on the request (its engine stopped, or every retry failed)."""


class TransferError(RuntimeError):
    """A KV send or receive failed, timed out, or its peer went away (kvtransfer/): the
    channel it was on is broken. Here rather than in kvtransfer so that the coordinator, which
    loads no transport, can tell a broken channel from any other failed prefill."""
