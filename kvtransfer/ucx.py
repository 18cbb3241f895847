"""UCX channels (ucxx): shared memory, TCP, InfiniBand or CUDA IPC, whichever UCX selects.

A channel is one UCX endpoint each way plus a lifeline: a plain TCP connection that carries the
handshake and then nothing, so that its end says the peer process is gone on every transport.

    accept (decode side, hosts the store)         connect (prefill side)
    listen for the lifeline
    store[key/ucx] = {address, port, tag}  ---->  read store[key/ucx], endpoint to `address`
    accept the lifeline                    <----  dial it, send this worker's address
    endpoint to the prefill's address      ---->  "ready": both ends are up

Message n on a channel is a tagged message with tag `channel tag << 32 | n`: the n-th receive
matches exactly the n-th send, so order holds whatever the transport. Channel tags come from the
accepting worker, where receives are matched.

UCX's own dead-peer detection (error handling mode "peer") rules out its shared-memory transports,
so it is on unless every transport in UCX_TLS is on-host (`sm`, `cma`, `cuda_ipc`...); there the
lifeline alone finds a dead peer, as it does on every transport.

Transports: `ucx` takes UCX_TLS from the environment (UCX's default: all). `ucx-shm` and `ucx-tcp`
pin shared memory or TCP (the tests and the benchmark run both).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import msgpack
import torch
from torch.distributed import TCPStore

from kvtransfer.sockets import keep_alive, left, listener, read_offer, recv_message, send_message
from kvtransfer.transport import TransferError, register
from kvtransfer.ucx_worker import GRACE, UcxWorker
from protocol.kv import Endpoint

ON_HOST = frozenset(
    {"self", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "cuda_copy", "cuda_ipc"}
)
SHM_TLS = "sm,self"
TCP_TLS = "tcp,self"
SEQ_MASK = (1 << 32) - 1


class UcxPending:
    """One posted send or receive. Holds its buffer until UCX is done with it; a receive into a
    non-contiguous tensor lands in `staged` and is copied over by the wait."""

    def __init__(self, channel: UcxChannel, request, buffer, staged, copy_to) -> None:
        self.channel, self.request, self.buffer = channel, request, buffer
        self.staged: torch.Tensor = staged
        self.copy_to: torch.Tensor | None = copy_to

    def wait(self, timeout: float | None) -> None:
        channel = self.channel
        try:
            channel.worker.wait(self.request, self.buffer, timeout, channel)
        except TransferError as err:
            channel.error = channel.error or str(err)
            raise
        if self.copy_to is not None:
            self.copy_to.copy_(self.staged)
            self.copy_to = None

    @property
    def finished(self) -> bool:
        return self.request.completed


class UcxChannel:
    """One thread at a time posts on a channel: the tag sequence is the posting order."""

    def __init__(
        self,
        worker: UcxWorker,
        endpoint,
        lifeline: socket.socket,
        tag: int,
        key: str,
        peer_error_handling: bool,
    ):
        self.worker = worker
        self.endpoint = endpoint
        self.peer_error_handling = peer_error_handling
        self.lifeline = lifeline
        self.lifeline_fd = lifeline.fileno()
        self.key = key
        self.hung_up_at: float | None = None  # set by whichever thread drives the worker
        self.error: str | None = None
        self._tag = tag << 32
        self._seq = 0
        worker.watch(self)

    def send(self, tensor: torch.Tensor, timeout: float) -> None:
        self.send_async(tensor).wait(timeout)

    def recv(self, tensor: torch.Tensor, timeout: float | None) -> None:
        self.recv_async(tensor).wait(timeout)

    def send_async(self, tensor: torch.Tensor) -> UcxPending:
        return self._post("tag_send", tensor.contiguous(), None)

    def skip_message(self) -> None:
        """Tests only (kvtransfer/faults.py): the next message is lost on the wire."""
        self._seq = (self._seq + 1) & SEQ_MASK

    def send_again(self, tensor: torch.Tensor) -> UcxPending:
        """Tests only: `tensor` once more under the last message's number (a duplicate)."""
        self._seq = (self._seq - 1) & SEQ_MASK
        return self.send_async(tensor)

    def recv_async(self, tensor: torch.Tensor) -> UcxPending:
        if tensor.is_contiguous():
            return self._post("tag_recv", tensor, None)
        staged = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return self._post("tag_recv", staged, tensor)

    def failure(self, now: float) -> str | None:
        if self.error is not None:
            return self.error
        if self.hung_up_at is not None and now >= self.hung_up_at + GRACE:
            return f"peer of channel {self.key!r} went away"
        return None

    def close(self) -> None:
        """Fails any call still waiting on the channel; flushes what was sent, then hangs up."""
        if self.endpoint is None:
            return
        self.worker.unwatch(self)
        healthy = self.error is None
        self.error = self.error or "channel closed"
        self.worker.hang_up(self)
        if healthy:
            closing = self.endpoint.close()
            with contextlib.suppress(TransferError):  # flush what this side sent
                self.worker.wait(closing, None, 1.0, None)
        elif not self.endpoint.alive:
            pass  # UCX found the peer gone and failed what was posted; closing it crashes ucxx
        elif self.peer_error_handling:
            # What is still posted (the receives of a channel given up on a deadline) must be
            # cancelled, so their requests complete and their buffers can go. ucxx's
            # non-blocking close leaves them posted; its blocking one cancels them, and with
            # peer error handling closes without waiting for the peer.
            self.worker.close_blocking(self.endpoint)
        else:
            # Without peer error handling the blocking close flushes first, which a stopped
            # peer could hold up for good: close without waiting (receives stay posted until
            # a message or the peer's close ends them).
            self.endpoint.close()
        self.lifeline.close()
        self.endpoint = None

    def _post(self, method: str, tensor: torch.Tensor, copy_to: torch.Tensor | None) -> UcxPending:
        """`method`: the endpoint's, named (a closed channel has no endpoint to ask)."""
        reason = self.failure(time.monotonic())
        if reason is not None:
            raise TransferError(f"channel {self.key!r} is broken: {reason}")
        post = getattr(self.endpoint, method)
        if tensor.is_cuda:  # UCX copies on its own stream: pending writes must land first
            torch.cuda.current_stream(tensor.device).synchronize()
        flat = tensor.reshape(-1).view(torch.uint8)  # a view: the tensor is contiguous
        buffer = self.worker.Array(flat if flat.is_cuda else flat.numpy())
        tag = self.worker.ucx.UCXXTag(self._tag | self._seq)
        self._seq = (self._seq + 1) & SEQ_MASK
        try:
            request = post(buffer, tag)
        except self.worker.ucx.UCXError as err:
            self.error = f"UCX: {err}"
            raise TransferError(self.error) from err
        self.worker.track(request, buffer)
        return UcxPending(self, request, buffer, tensor, copy_to)


class UcxTransport:
    def __init__(
        self,
        device: torch.device,
        name: str = "ucx",
        tls: str | None = None,
        peer_error_handling: bool | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self.tls = tls or os.environ.get("UCX_TLS", "all")
        options = {"TLS": self.tls}
        if device.type != "cuda":  # ucxx defaults rendezvous staging to CUDA memory
            options["RNDV_FRAG_MEM_TYPE"] = "host"
        on_host = set(self.tls.replace(" ", "").split(",")) <= ON_HOST
        self.peer_error_handling = (
            not on_host if peer_error_handling is None else peer_error_handling
        )
        self.worker = UcxWorker(device, options)
        if device.type == "cuda" and not self.worker.context.cuda_support:
            raise ValueError(f"UCX has no CUDA transport with UCX_TLS={self.tls}")

    def describe(self) -> str:
        """For the startup log: which transports UCX may use, and how a dead peer is found."""
        handling = "on" if self.peer_error_handling else "off (lifeline only)"
        return f"{self.name} (UCX_TLS={self.tls}, peer error handling {handling})"

    def close(self) -> None:
        """Stops the worker's background thread; close the channels first."""
        self.worker.close()

    def connect(self, rendezvous: Endpoint, key: str, timeout: float) -> UcxChannel:
        deadline = time.monotonic() + timeout
        offer = read_offer(rendezvous, f"{key}/ucx", timeout)
        try:
            lifeline = socket.create_connection((rendezvous.host, offer["port"]), left(deadline))
        except OSError as err:
            raise TransferError(f"cannot reach the lifeline of channel {key!r}: {err}") from err
        try:
            keep_alive(lifeline)
            send_message(lifeline, self.worker.address, deadline)
            endpoint = self.worker.endpoint(offer["address"], self.peer_error_handling)
            if recv_message(lifeline, deadline) != b"ready":
                raise TransferError(f"channel {key!r}: bad handshake")
        except (OSError, TransferError) as err:
            lifeline.close()
            raise TransferError(f"channel {key!r} did not open: {err}") from err
        return UcxChannel(
            self.worker, endpoint, lifeline, offer["tag"], key, self.peer_error_handling
        )

    def accept(self, rendezvous: TCPStore, key: str, timeout: float) -> UcxChannel:
        deadline = time.monotonic() + timeout
        tag = self.worker.new_tag()
        try:
            with listener() as server:
                offer = {
                    "address": self.worker.address,
                    "port": server.getsockname()[1],
                    "tag": tag,
                }
                rendezvous.set(f"{key}/ucx", msgpack.packb(offer))
                server.settimeout(left(deadline))
                lifeline, _ = server.accept()
        except OSError as err:  # socket.timeout included
            raise TransferError(f"channel {key!r}: no peer connected: {err}") from err
        try:
            keep_alive(lifeline)
            peer = recv_message(lifeline, deadline)
            endpoint = self.worker.endpoint(peer, self.peer_error_handling)
            send_message(lifeline, b"ready", deadline)
            rendezvous.delete_key(f"{key}/ucx")
        except (OSError, TransferError) as err:
            lifeline.close()
            raise TransferError(f"channel {key!r} did not open: {err}") from err
        return UcxChannel(self.worker, endpoint, lifeline, tag, key, self.peer_error_handling)


def _with_device_tls(device: torch.device, tls: str, cuda_tls: str) -> str:
    return f"{tls},{cuda_tls}" if device.type == "cuda" else tls


@register("ucx")
def _ucx(device: torch.device) -> UcxTransport:
    return UcxTransport(device)


@register("ucx-shm")
def _ucx_shm(device: torch.device) -> UcxTransport:
    return UcxTransport(device, "ucx-shm", _with_device_tls(device, SHM_TLS, "cuda_copy,cuda_ipc"))


@register("ucx-tcp")
def _ucx_tcp(device: torch.device) -> UcxTransport:
    return UcxTransport(device, "ucx-tcp", _with_device_tls(device, TCP_TLS, "cuda_copy"))
