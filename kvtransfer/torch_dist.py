"""torch.distributed point-to-point channels: gloo for CPU tensors, nccl for CUDA tensors.

Each (prefill, decode) pair gets its own two-rank process group on a prefix of the decode
worker's store, so there is no global world: pairs open and close as pools change. Message n
on a channel carries tag n, so a message can only land in the receive posted for it: a lost one
leaves its receive waiting (until its deadline), a doubled one is never received, and neither
shifts the others into receives of another size (which gloo answers by aborting the process).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
from torch.distributed import PrefixStore, Store, TCPStore

from kvtransfer.transport import TransferError, dial_store, register
from protocol.kv import Endpoint

SENDER, RECEIVER = 0, 1
TAG_MASK = (1 << 31) - 1
# How long an idle receiver may wait for its next message; a dead peer ends the wait sooner.
IDLE_WAIT = datetime.timedelta(days=7)


def _seconds(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout, 0.001))


class _Pending:
    """One posted send or receive; holds its buffer until the wait."""

    def __init__(
        self,
        work,
        buffer: torch.Tensor,
        copy_to: torch.Tensor | None = None,
        ended_by_error: bool = False,
    ) -> None:
        """`ended_by_error`: a wait that fails other than by its deadline (the peer gone, the
        connection reset) ends the operation (gloo): the buffer is the backend's no more."""
        self.work, self.buffer, self.copy_to = work, buffer, copy_to
        self.ended_by_error = ended_by_error
        self.finished = False

    def wait(self, timeout: float | None) -> None:
        try:
            self.work.wait(IDLE_WAIT if timeout is None else _seconds(timeout))
        except RuntimeError as err:
            message = str(err).splitlines()[0]
            if self.ended_by_error and "timed out" not in message.lower():
                # (held as still posted, a dead peer's receive kept its whole gloo context,
                # a thread and six sockets, for as long as the worker lived)
                self.finished = True
            raise TransferError(message) from err
        # Only a wait that succeeded says the backend is done with the buffer: a gloo work
        # marks itself completed when its wait times out, with the receive still posted.
        self.finished = True
        if self.copy_to is not None:
            self.copy_to.copy_(self.buffer)


class ProcessGroupChannel:
    """`device` is where the backend wants tensors (CPU for gloo, the GPU for nccl); tensors
    elsewhere (small message frames) are staged through it."""

    def __init__(self, group, rank: int, device: torch.device) -> None:
        self.group = group
        self.peer = RECEIVER if rank == SENDER else SENDER
        self.device = device
        self._seq = 0  # the next message's tag; one side sends, the other receives

    def send(self, tensor: torch.Tensor, timeout: float) -> None:
        self.send_async(tensor).wait(timeout)

    def recv(self, tensor: torch.Tensor, timeout: float | None) -> None:
        self.recv_async(tensor).wait(timeout)

    def send_async(self, tensor: torch.Tensor) -> _Pending:
        staged = tensor.to(self.device)
        return _Pending(self._post(self._group().send, staged), staged, None, self._gloo)

    def recv_async(self, tensor: torch.Tensor) -> _Pending:
        if tensor.device == self.device:
            return _Pending(self._post(self._group().recv, tensor), tensor, None, self._gloo)
        staged = torch.empty_like(tensor, device=self.device)
        return _Pending(self._post(self._group().recv, staged), staged, tensor, self._gloo)

    @property
    def _gloo(self) -> bool:
        return self.device.type == "cpu"

    def _group(self):  # noqa: ANN202
        if self.group is None:  # (an AttributeError before: closed, it is a TransferError)
            raise TransferError("the channel is closed")
        return self.group

    def skip_message(self) -> None:
        """Tests only (kvtransfer/faults.py): the next message is lost on the wire."""
        self._seq = (self._seq + 1) & TAG_MASK

    def send_again(self, tensor: torch.Tensor) -> _Pending:
        """Tests only: `tensor` once more under the last message's tag (a duplicate)."""
        self._seq = (self._seq - 1) & TAG_MASK
        return self.send_async(tensor)

    def _post(self, post, tensor: torch.Tensor):
        """Posting fails at once when the peer is known dead (gloo checks its socket there)."""
        if self.group is None:
            raise TransferError("channel is closed")
        tag, self._seq = self._seq, (self._seq + 1) & TAG_MASK
        try:
            return post([tensor], self.peer, tag)
        except RuntimeError as err:
            raise TransferError(str(err).splitlines()[0]) from err

    def close(self) -> None:
        self.group = None


class TorchDistTransport:
    def __init__(self, backend: str, device: torch.device) -> None:
        self.name = backend
        self.device = device

    def connect(self, rendezvous: Endpoint, key: str, timeout: float) -> ProcessGroupChannel:
        # This side's gloo address: the one it reaches the decode worker's host from.
        local = _address_towards(rendezvous.host)
        return self._open(dial_store(rendezvous, timeout), key, SENDER, timeout, local)

    def accept(self, rendezvous: TCPStore, key: str, timeout: float) -> ProcessGroupChannel:
        # The store is hosted on this worker's own address (Rendezvous): gloo listens there too.
        return self._open(rendezvous, key, RECEIVER, timeout, rendezvous.host)

    def _open(
        self, store: Store, key: str, rank: int, timeout: float, local: str
    ) -> ProcessGroupChannel:
        prefixed = PrefixStore(key, store)
        try:
            if self.name == "nccl":
                group = _nccl_group(prefixed, rank, timeout)
            else:
                group = _gloo_group(prefixed, rank, timeout, local)
        except RuntimeError as err:
            raise TransferError(f"channel {key!r} did not open: {err}") from err
        device = self.device if self.name == "nccl" else torch.device("cpu")
        return ProcessGroupChannel(group, rank, device)


def _gloo_group(store: Store, rank: int, timeout: float, local: str):
    """A two-rank gloo group whose socket listens on `local`, the address the peer can reach.
    Left to itself gloo takes what this machine's hostname resolves to, which is a loopback
    address on many hosts (127.0.1.1 on Debian and Ubuntu without DNS): a peer on another
    host then cannot connect. `GLOO_SOCKET_IFNAME` (torch's variable) names an interface
    instead. The group's own timeout bounds only the connection; each wait passes its own."""
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = _seconds(timeout)
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    create = torch.distributed.ProcessGroupGloo.create_device
    options._devices = [create(interface=interface) if interface else create(hostname=local)]
    return torch.distributed.ProcessGroupGloo(store, rank, 2, options)


def _address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP socket's
    connect only picks the route)."""
    try:
        with socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM
        ) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return host if host.startswith("127.") else ""


def _nccl_group(store: Store, rank: int, timeout: float):
    options = torch.distributed.ProcessGroupNCCL.Options()
    options._timeout = _seconds(timeout)
    return torch.distributed.ProcessGroupNCCL(store, rank, 2, options)


@register("gloo")
def _gloo(device: torch.device) -> TorchDistTransport:
    return TorchDistTransport("gloo", device)


@register("nccl")
def _nccl(device: torch.device) -> TorchDistTransport:
    if device.type != "cuda":
        raise ValueError("the nccl transport moves CUDA tensors; use gloo on CPU")
    return TorchDistTransport("nccl", device)
