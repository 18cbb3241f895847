"""The Transport seam: how KV bytes get from a prefill worker to a decode worker.

A decode worker hosts a rendezvous store (`Rendezvous`); a ticket carries its address. For each
(prefill, decode) pair the prefill side `connect`s and the decode side `accept`s under the same
channel key, lazily, the first time the pair has something to move. The result is a `Channel`:
one direction (prefill -> decode), one peer, an ordered and reliable stream of tensors.

Contract every backend keeps:
  - `send` / `recv` complete in order; a receive fills exactly the tensor it was given;
  - every call takes a timeout, and a timeout or a dead peer raises TransferError;
  - after any error the channel is broken for good: callers close it and open a new one under a
    new key (a half-finished message cannot be resynchronised).
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable
from typing import Protocol

import torch
from torch.distributed import TCPStore

from kvtransfer.names import TRANSPORT_NAMES
from protocol.errors import TransferError as TransferError  # (imported from here too)
from protocol.kv import Endpoint


class Pending(Protocol):
    def wait(self, timeout: float | None) -> None:
        """Returns when the operation completed; raises TransferError on failure or timeout
        (`None`: no deadline, for an idle receiver; a dead peer still ends the wait)."""

    @property
    def finished(self) -> bool:
        """The transport is done with the buffer (the operation completed, failed or was
        cancelled): it writes or reads it no more, so it may be released."""


class Channel(Protocol):
    def send(self, tensor: torch.Tensor, timeout: float) -> None: ...

    def recv(self, tensor: torch.Tensor, timeout: float | None) -> None:
        """Fills `tensor`; `timeout=None` waits until data comes or the peer goes away."""

    def send_async(self, tensor: torch.Tensor) -> Pending:
        """Posts a send; `tensor` must not change until the wait returns. Posted operations
        complete in posting order, so several may be in flight at once."""

    def recv_async(self, tensor: torch.Tensor) -> Pending: ...

    def close(self) -> None: ...


class Transport(Protocol):
    name: str

    def connect(self, rendezvous: Endpoint, key: str, timeout: float) -> Channel:
        """Sending side of the channel `key`; blocks until the peer has accepted it."""

    def accept(self, rendezvous: TCPStore, key: str, timeout: float) -> Channel:
        """Receiving side of the channel `key`, on the store this worker hosts."""


class Rendezvous:
    """The store a decode worker hosts so prefill workers can find it."""

    def __init__(self, host: str, joining: Endpoint | None = None) -> None:
        """`joining`: use that store instead of hosting one (a tensor-parallel decode
        worker's follower ranks use their rank 0's)."""
        timeout = datetime.timedelta(seconds=30)
        if joining is None:
            self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        else:
            self.store = TCPStore(joining.host, joining.port, is_master=False, timeout=timeout)
        self.endpoint = Endpoint(joining.host if joining else host, self.store.port)

    def client(self) -> TCPStore:
        """A connection of its own to the store. A channel waiting for a peer blocks its store
        client until the peer comes (or the timeout), so concurrent accepts each need one:
        sharing one, a dead peer's pending accept would hold up every new channel."""
        return TCPStore(
            self.endpoint.host,
            self.endpoint.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=30),
        )


def dial_store(rendezvous: Endpoint, timeout: float) -> TCPStore:
    """A client of a decode worker's rendezvous store. The store of a worker that is gone
    refuses at once, but TCPStore retries a refusal for more than twice `timeout` (each try
    waits out the whole timeout), so a plain connection asks first."""
    seconds = max(timeout, 0.001)
    try:
        socket.create_connection((rendezvous.host, rendezvous.port), seconds).close()
        return TCPStore(
            rendezvous.host,
            rendezvous.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=seconds),
        )
    except (OSError, RuntimeError) as err:
        raise TransferError(f"cannot reach the rendezvous at {rendezvous}: {err}") from err


DIAL_GRACE_S = 1.0  # past the transport's own deadline, which normally fires first


def connect_within(transport: Transport, rendezvous: Endpoint, key: str, timeout: float) -> Channel:
    """`transport.connect`, given up after `timeout` (and a grace) even where the transport's
    own deadline does not hold: TCPStore waits with none for a store that accepted the
    connection and never answers (a frozen decode worker's; the kernel accepts for it). The
    dial then goes on in the background, and a channel it opens late is closed."""
    outcome: dict[str, object] = {}
    lock = threading.Lock()
    done = threading.Event()

    def dial() -> None:
        try:
            channel = transport.connect(rendezvous, key, timeout)
        except Exception as err:  # handed to the caller, who raises it
            outcome["error"] = err
        else:
            with lock:
                if "abandoned" in outcome:
                    channel.close()
                else:
                    outcome["channel"] = channel
        finally:
            done.set()

    threading.Thread(target=dial, name=f"kv-dial-{key}", daemon=True).start()
    answered = done.wait(timeout + DIAL_GRACE_S)
    with lock:
        if "channel" in outcome:
            return outcome["channel"]  # type: ignore[return-value]
        if not answered:
            outcome["abandoned"] = True
            raise TransferError(f"channel {key!r}: {rendezvous} did not answer in {timeout:.1f}s")
    err = outcome["error"]
    if isinstance(err, TransferError):
        raise err
    raise TransferError(f"channel {key!r} did not open: {err}") from err  # type: ignore[misc]


TRANSPORTS: dict[str, Callable[[torch.device], Transport]] = {}
CUDA_AUTO = "ipc/nccl"  # `auto` on CUDA; a worker's follower ranks make theirs by this name


def register(name: str) -> Callable:
    assert name in TRANSPORT_NAMES, f"add {name!r} to kvtransfer.names.TRANSPORT_NAMES"

    def add(factory: Callable[[torch.device], Transport]) -> Callable[[torch.device], Transport]:
        TRANSPORTS[name] = factory
        return factory

    return add


def make_transport(name: str, device: torch.device) -> Transport:
    """`auto`: gloo on CPU; on CUDA, CUDA IPC between two workers on one device and NCCL
    between devices (decided per channel, when it opens)."""
    import kvtransfer.ipc
    import kvtransfer.torch_dist  # noqa: F401  (registers gloo and nccl)

    if name in ("auto", CUDA_AUTO) and device.type == "cuda":  # CUDA_AUTO: what it is named
        return kvtransfer.ipc.IpcTransport(device, fallback=TRANSPORTS["nccl"](device))
    if name == "auto":
        name = "gloo"
    if name.startswith("ucx"):
        import kvtransfer.ucx  # noqa: F401  (ucx, ucx-shm, ucx-tcp; needs the ucxx package)
    if name not in TRANSPORTS:
        raise ValueError(
            f"unknown KV transport {name!r}; choose from auto, {', '.join(TRANSPORT_NAMES)}"
        )
    return TRANSPORTS[name](device)
