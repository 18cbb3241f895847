"""The KV transports the transfer tests run over, as pytest params (ucx ones skipped where ucxx is
not installed), and how a test makes and closes one on the CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvtransfer.transport import Transport, make_transport

CPU = torch.device("cpu")
needs_ucxx = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed: tandem[ucx]"
)
TRANSPORTS = [
    pytest.param("gloo", id="gloo"),
    pytest.param("ipc", id="ipc"),
    # ipc with every payload through the ring (none small enough for the socket), so that the
    # decode side reads them in place (lent receives): the tests' payloads are a few KiB.
    pytest.param("ipc-ring", id="ipc-ring"),
    pytest.param("ucx-shm", id="ucx-shm", marks=needs_ucxx),
    pytest.param("ucx-tcp", id="ucx-tcp", marks=needs_ucxx),
]


def transport_named(name: str) -> Transport:
    if name == "ipc-ring":
        from kvtransfer.ipc import IpcTransport

        return IpcTransport(CPU, inline_bytes=256)
    if name.startswith("ucx"):
        import kvtransfer.ucx  # noqa: F401  (registers the ucx-shm and ucx-tcp variants)
    return make_transport(name, CPU)


def close_transport(transport: Transport) -> None:
    """ucx transports own a UCX worker and a thread; gloo's own nothing."""
    if hasattr(transport, "close"):
        transport.close()
