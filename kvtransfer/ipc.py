"""Channels between two workers on one host that share memory: CUDA IPC on a GPU (the two
workers on one device, where NCCL cannot make them two ranks), a POSIX shared-memory file on CPU.

The sending side owns a ring of `slots` buffers of `slot_bytes` each, on its device, and lends
it to the receiver once, when the channel opens (the owner writes it, so a receiver that died
leaves the sender writing only its own memory; the receiver reads a slot only when the living
sender says it is full). A TCP connection between the two carries everything else: small
messages themselves, and for each piece of a large one a note that it is in its slot; back the
other way, one byte per slot emptied, in slot order.

    sender                                             receiver
    header (seq, nbytes)               --socket-->     checks seq and size against its receive
    small message: its bytes follow    --socket-->     read into the tensor
    large message, piece by piece:
      wait for a free slot (credit)    <--socket--     one byte per slot it emptied
      copy the piece into ring[slot], wait for it
      piece length                     --socket-->     copy ring[slot] into the tensor, wait,
                                                       credit; or, for a lent receive (one
                                                       piece), hand the slot itself to the
                                                       caller and credit once it is released

Both sides count pieces, so the slot of piece n is n % slots on each without saying so. The
sender's stream waits for the packing stream's event; each side waits for its own copy before it
tells the other, so no CUDA event crosses processes. Message n carries sequence number n: a
duplicate (an older number) is read and dropped, a gap (a message lost) breaks the channel at
once. The connection's end is how each side learns the other died: every wait is on the socket
or on an event with a deadline.

Why CUDA IPC through torch (`torch.multiprocessing.reductions`) and not UCX's `cuda_ipc`: it needs
nothing but torch, which the GPU machines have, where ucxx is a separate CUDA-versioned build.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import math
import mmap
import os
import pickle
import queue
import socket
import struct
import tempfile
import threading
import time
import uuid

import msgpack
import torch
from torch.distributed import TCPStore

from kvtransfer import streams
from kvtransfer.sockets import (
    keep_alive,
    left,
    listener,
    read_offer,
    recv_exactly,
    recv_message,
    send_message,
)
from kvtransfer.transport import Channel, TransferError, Transport, register
from protocol.kv import Endpoint

HEADER = struct.Struct("<QQ")  # message number, bytes
PIECE = struct.Struct("<Q")  # bytes of a piece now in its slot
INLINE_BYTES = 64 << 10  # by default messages up to this size travel on the socket itself
SEQ_MASK = (1 << 64) - 1
# The sender's ring per channel: four slots, so the sender fills one while the receiver
# empties another. On a GPU this comes on top of the KV cache (--gpu-memory-utilization).
GPU_SLOT_BYTES = 64 << 20  # one layer's payload of a 16k-token prompt on an 8B model
CPU_SLOT_BYTES = 4 << 20
SLOTS = 4

# Rings this process lends, by token: a sender in the same process (the tests' two threads)
# uses the tensor itself, since CUDA refuses to open a process's own IPC handle.
_LOCAL_RINGS: dict[str, torch.Tensor] = {}


def _host_id() -> str:
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()
    return socket.gethostname()


def _device_id(device: torch.device) -> str:
    """The GPU's identity across processes (each may number its visible GPUs from 0)."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    uuid_ = getattr(props, "uuid", None)
    if uuid_ is not None:
        return str(uuid_)
    return "pci:" + ":".join(
        str(getattr(props, f"pci_{k}_id", "?")) for k in ("domain", "bus", "device")
    )


class _Ring:
    """`slots` buffers of `slot_bytes`, back to back in one uint8 tensor; `keep` holds what
    the tensor's memory lives on (the mapping of the shared file on CPU). Messages up to
    `inline_bytes` bypass it (both ends take the sender's value)."""

    def __init__(self, tensor: torch.Tensor, layout: dict, keep: object | None = None) -> None:
        self.tensor, self.keep = tensor, keep
        self.slots, self.slot_bytes = layout["slots"], layout["slot_bytes"]
        self.inline_bytes: int = layout["inline_bytes"]

    def slot(self, piece: int, nbytes: int) -> torch.Tensor:
        start = (piece % self.slots) * self.slot_bytes
        return self.tensor[start : start + nbytes]


def _lend_ring(device: torch.device, layout: dict) -> tuple[_Ring, dict]:
    """A new ring on `device` and how a peer process maps it (msgpack-able); `_forget_ring`
    once the peer has mapped it or failed to."""
    token = uuid.uuid4().hex
    size = layout["slots"] * layout["slot_bytes"]
    if device.type == "cuda":
        tensor = torch.empty(size, dtype=torch.uint8, device=device)
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(tensor)
        ring, how = _Ring(tensor, layout), {"cuda": pickle.dumps((rebuild, args))}
    else:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"tandem-kv-{token}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Allocated now: a /dev/shm too small for the ring is ENOSPC here, not a SIGBUS
            # in the worker at its first write into a page the file never had.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
        except OSError:  # no ring after all: nothing left in /dev/shm either
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        tensor = torch.frombuffer(mapped, dtype=torch.uint8)
        ring, how = _Ring(tensor, layout, mapped), {"path": path}
    _LOCAL_RINGS[token] = tensor
    return ring, {"token": token, **layout, **how}


def _map_ring(offer: dict) -> _Ring:
    """The receiver's view of the sender's ring."""
    local = _LOCAL_RINGS.get(offer["token"])
    if local is not None:
        return _Ring(local, offer)
    if "cuda" in offer:
        rebuild, args = pickle.loads(offer["cuda"])  # noqa: S301  (our own peer's offer)
        return _Ring(rebuild(*args), offer)
    fd = os.open(offer["path"], os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, offer["slots"] * offer["slot_bytes"])
    finally:
        os.close(fd)
    return _Ring(torch.frombuffer(mapped, dtype=torch.uint8), offer, mapped)


def _forget_ring(offer: dict) -> None:
    """Once the receiver has mapped the ring: the file's name is no longer needed (its memory
    lives while either side maps it), and nothing is left in /dev/shm if a worker dies."""
    _LOCAL_RINGS.pop(offer["token"], None)
    if "path" in offer:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(offer["path"])


class IpcPending:
    """One posted send or receive; `finished` once the channel's thread is done with its
    buffer (completed, failed or cancelled).

    A lent receive (`IpcChannel.recv_lent_async`) has no buffer of its own: once waited for,
    `tensor` is the ring's slot itself, the sender's bytes read in place, until `release()`."""

    def __init__(
        self,
        channel: IpcChannel,
        seq: int,
        nbytes: int,
        flat: torch.Tensor | None = None,
        copy: tuple | None = None,
        lent: tuple | None = None,
    ) -> None:
        """`flat`: the bytes sent or received into. `copy`: (staged, tensor) for a receive into
        a non-contiguous tensor, copied over by the wait. `lent`: (shape, dtype) of a lent
        receive."""
        self.channel, self.seq, self.nbytes = channel, seq, nbytes
        self.flat, self.copy, self.lent = flat, copy, lent
        self.tensor: torch.Tensor | None = None
        self.piece: int | None = None  # a lent receive's piece, credited on release
        self.ready: torch.cuda.Event | None = None
        if flat is not None and flat.is_cuda:  # the channel waits for what was queued before
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.error: str | None = None
        self._done = threading.Event()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def end(self, error: str | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self, timeout: float | None) -> None:
        if not self._done.wait(timeout):
            reason = f"no transfer within {timeout:.1f}s"
            self.channel.fail(reason)
            raise TransferError(f"channel {self.channel.key!r}: {reason}")
        if self.error is not None:
            raise TransferError(f"channel {self.channel.key!r}: {self.error}")
        if self.copy is not None:
            staged, tensor = self.copy
            tensor.copy_(staged)
            self.copy = None

    def release(self) -> None:
        """A lent receive is done with its slot (what read it has finished): the sender may
        fill it again."""
        if self.piece is not None:
            piece, self.piece, self.tensor = self.piece, None, None
            self.channel.credit(piece)


class IpcChannel:
    """One direction: the sender's side sends, the receiver's receives. A thread per side
    carries out what was posted, in order; the first error breaks the channel for good."""

    def __init__(
        self, sock: socket.socket, ring: _Ring, device: torch.device, key: str, sending: bool
    ) -> None:
        self.sock, self.ring, self.device, self.key = sock, ring, device, key
        self.error: str | None = None
        self._seq = 0  # the next message's number
        self._lock = threading.Lock()
        self._posted: queue.SimpleQueue[IpcPending | None] = queue.SimpleQueue()
        self._pieces = itertools.count()  # pieces through the ring so far: slot = n % slots
        self._free = ring.slots  # the sender's credits
        # The receiver's credits go back in piece order (the sender refills the oldest slot
        # first), so a piece emptied while an older one is still lent waits for it.
        self._next_credit = 0
        self._emptied: set[int] = set()
        role = "send" if sending else "recv"
        self._thread = threading.Thread(
            target=self._serve, args=(self._send if sending else self._recv,), daemon=True
        )
        self._thread.name = f"kv-ipc-{role}-{key}"
        self._thread.start()

    def send(self, tensor: torch.Tensor, timeout: float) -> None:
        self.send_async(tensor).wait(timeout)

    def recv(self, tensor: torch.Tensor, timeout: float | None) -> None:
        self.recv_async(tensor).wait(timeout)

    def send_async(self, tensor: torch.Tensor) -> IpcPending:
        flat = _flat_bytes(tensor.contiguous())
        return self._post(flat.numel(), flat=flat)

    def recv_async(self, tensor: torch.Tensor) -> IpcPending:
        if tensor.is_contiguous():
            flat = _flat_bytes(tensor)
            return self._post(flat.numel(), flat=flat)
        staged = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        flat = _flat_bytes(staged)
        return self._post(flat.numel(), flat=flat, copy=(staged, tensor))

    def recv_lent_async(self, shape: tuple[int, ...], dtype: torch.dtype) -> IpcPending | None:
        """A receive read in place from the ring: the wait leaves the message in
        `pending.tensor` ([shape] of dtype, on the ring's device) until `pending.release()`;
        one copy a byte instead of two. None where the message would not lie in one slot
        (larger than a slot, or small enough to travel on the socket): receive it as usual."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= self.ring.inline_bytes or nbytes > self.ring.slot_bytes:
            return None
        return self._post(nbytes, lent=(shape, dtype))

    def skip_message(self) -> None:
        """Tests only (kvtransfer/faults.py): the next message is lost on the wire."""
        self._seq = (self._seq + 1) & SEQ_MASK

    def send_again(self, tensor: torch.Tensor) -> IpcPending:
        """Tests only: `tensor` once more under the last message's number (a duplicate)."""
        self._seq = (self._seq - 1) & SEQ_MASK
        return self.send_async(tensor)

    def fail(self, reason: str) -> None:
        """Breaks the channel: whatever is posted or blocked ends with an error."""
        with self._lock:
            self.error = self.error or reason
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.fail("channel closed")
        self._posted.put(None)
        self._thread.join(timeout=5.0)
        self.sock.close()

    def credit(self, piece: int) -> None:
        """The receiver emptied `piece`'s slot; credits the sender with every slot emptied in
        order so far."""
        with self._lock:
            self._emptied.add(piece)
            count = 0
            while self._next_credit in self._emptied:
                self._emptied.discard(self._next_credit)
                self._next_credit += 1
                count += 1
            if count and self.error is None:
                with contextlib.suppress(OSError):  # a broken channel needs no credits
                    self.sock.sendall(b"\x01" * count)

    def _post(self, nbytes: int, **what) -> IpcPending:
        with self._lock:
            if self.error is not None:
                raise TransferError(f"channel {self.key!r} is broken: {self.error}")
            pending = IpcPending(self, self._seq, nbytes, **what)
            self._seq = (self._seq + 1) & SEQ_MASK
            self._posted.put(pending)
        return pending

    def _serve(self, carry) -> None:
        """The channel's thread: carries out each posted operation in turn, until close()
        (whose marker comes after everything posted before it)."""
        streams.use_own_stream(self.device)
        while (pending := self._posted.get()) is not None:
            if self.error is not None:
                pending.end(self.error)
                continue
            try:
                carry(pending)
            except Exception as err:  # any failure ends this operation and the channel
                self.fail(str(err) or type(err).__name__)
                pending.end(self.error)
            else:
                pending.end()

    def _send(self, pending: IpcPending) -> None:
        flat, nbytes = pending.flat, pending.nbytes
        header = HEADER.pack(pending.seq, nbytes)
        if pending.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(pending.ready)
        if nbytes <= self.ring.inline_bytes:
            body = flat.cpu() if flat.is_cuda else flat  # .cpu() waits for the stream
            self.sock.sendall(header + memoryview(body.numpy()).tobytes())
            return
        self.sock.sendall(header)
        for start in range(0, nbytes, self.ring.slot_bytes):
            size = min(self.ring.slot_bytes, nbytes - start)
            while self._free == 0:  # wait for the receiver to empty a slot
                self._free += len(_recv_some(self.sock, self.ring.slots))
            self._free -= 1
            self.ring.slot(next(self._pieces), size).copy_(flat[start : start + size])
            streams.settle(self.device)
            self.sock.sendall(PIECE.pack(size))

    def _recv(self, pending: IpcPending) -> None:
        while True:
            seq, nbytes = HEADER.unpack(recv_exactly(self.sock, HEADER.size))
            if seq == pending.seq:
                break
            if (pending.seq - seq) & SEQ_MASK > (1 << 63):  # a later number: one was lost
                raise TransferError(f"message {pending.seq} lost (message {seq} came first)")
            self._take(None, nbytes)  # a duplicate of one already received: dropped
        if nbytes != pending.nbytes:
            raise TransferError(
                f"message {seq} has {nbytes} bytes; its receive expects {pending.nbytes}"
            )
        if pending.lent is not None:  # one piece, left in its slot until released
            (size,) = PIECE.unpack(recv_exactly(self.sock, PIECE.size))
            shape, dtype = pending.lent
            pending.piece = next(self._pieces)
            pending.tensor = self.ring.slot(pending.piece, size).view(dtype).view(shape)
            return
        if pending.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(pending.ready)
        self._take(pending.flat, nbytes)

    def _take(self, flat: torch.Tensor | None, nbytes: int) -> None:
        """Reads a message's body into `flat` (None: reads and drops it)."""
        if nbytes <= self.ring.inline_bytes:
            data = recv_exactly(self.sock, nbytes)
            if flat is not None and nbytes:  # (torch.frombuffer refuses an empty buffer)
                flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                streams.settle(self.device)
            return
        for start in range(0, nbytes, self.ring.slot_bytes):
            (size,) = PIECE.unpack(recv_exactly(self.sock, PIECE.size))
            piece = next(self._pieces)
            if flat is not None:
                flat[start : start + size].copy_(self.ring.slot(piece, size))
                streams.settle(self.device)
            self.credit(piece)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _recv_some(sock: socket.socket, most: int) -> bytes:
    data = sock.recv(most)
    if not data:
        raise TransferError("the peer closed the connection")
    return data


class IpcTransport:
    """`fallback`: the transport a pair on two devices or hosts uses instead (the CUDA `auto`:
    NCCL). Without one, such a pair is an error. The ring's layout (`slots`, `slot_bytes`,
    `inline_bytes`) is the sending side's."""

    def __init__(
        self,
        device: torch.device,
        slots: int = SLOTS,
        slot_bytes: int | None = None,
        fallback: Transport | None = None,
        inline_bytes: int = INLINE_BYTES,
    ) -> None:
        self.device = device
        default = GPU_SLOT_BYTES if device.type == "cuda" else CPU_SLOT_BYTES
        self.layout = {
            "slots": slots,
            "slot_bytes": slot_bytes or default,
            "inline_bytes": inline_bytes,
        }
        self.fallback = fallback
        self.name = "ipc" if fallback is None else f"ipc/{fallback.name}"

    def connect(self, rendezvous: Endpoint, key: str, timeout: float) -> Channel:
        deadline = time.monotonic() + timeout
        offer = read_offer(rendezvous, f"{key}/ipc", timeout)
        here = {"host": _host_id(), "device": _device_id(self.device)}
        apart = offer["host"] != here["host"] or offer["device"] != here["device"]
        try:
            sock = socket.create_connection((rendezvous.host, offer["port"]), left(deadline))
        except OSError as err:
            raise TransferError(f"cannot reach channel {key!r}: {err}") from err
        if apart:  # both sides open the fallback's channel instead, or both fail at once
            with contextlib.closing(sock):
                send_message(sock, b"apart", deadline)
            if self.fallback is None:
                raise TransferError(
                    f"channel {key!r}: the ipc transport joins workers on one host and one "
                    f"device (peer {offer['device']} on host {offer['host']}, here "
                    f"{here['device']} on {here['host']}); use nccl or ucx between them"
                )
            return self.fallback.connect(rendezvous, f"{key}/apart", left(deadline))
        try:
            ring, lent = _lend_ring(self.device, self.layout)
        except (OSError, RuntimeError) as err:  # no memory for it, on the device or in /dev/shm
            sock.close()  # the peer hears of it now, not at its deadline
            raise TransferError(f"channel {key!r} did not open: no ring: {err}") from err
        try:
            send_message(sock, msgpack.packb(lent), deadline)
            if recv_message(sock, deadline) != b"mapped":
                raise TransferError("bad handshake")
        except (OSError, TransferError) as err:
            sock.close()
            raise TransferError(f"channel {key!r} did not open: {err}") from err
        finally:
            _forget_ring(lent)
        return IpcChannel(_data_socket(sock), ring, self.device, key, sending=True)

    def accept(self, rendezvous: TCPStore, key: str, timeout: float) -> Channel:
        deadline = time.monotonic() + timeout
        try:
            with listener() as server:
                offer = {
                    "port": server.getsockname()[1],
                    "host": _host_id(),
                    "device": _device_id(self.device),
                }
                rendezvous.set(f"{key}/ipc", msgpack.packb(offer))
                server.settimeout(left(deadline))
                sock, _ = server.accept()
        except (OSError, TransferError) as err:
            raise TransferError(f"channel {key!r}: no peer connected: {err}") from err
        try:
            answer = recv_message(sock, deadline)
            rendezvous.delete_key(f"{key}/ipc")
        except (OSError, TransferError) as err:
            sock.close()
            raise TransferError(f"channel {key!r} did not open: {err}") from err
        if answer == b"apart":
            sock.close()
            if self.fallback is None:
                raise TransferError(
                    f"channel {key!r}: the peer is on another host or device, which the ipc "
                    "transport does not join; use nccl or ucx between them"
                )
            return self.fallback.accept(rendezvous, f"{key}/apart", left(deadline))
        if not _from_this_host(sock):
            # A ring is only ever lent on one host, and its offer is unpickled (CUDA) or
            # names a file to map: from anywhere else it is no peer of ours.
            sock.close()
            raise TransferError(
                f"channel {key!r} did not open: a ring offered from another host, refused"
            )
        try:
            offer = msgpack.unpackb(answer)
            ring = _map_ring(offer)
            # Unlinked here too, once mapped: a sender killed before it hears "mapped" (and
            # unlinks it itself) would leave the ring's file in /dev/shm for good.
            _forget_ring(offer)
            send_message(sock, b"mapped", deadline)
        except (OSError, RuntimeError, ValueError, KeyError, TransferError) as err:
            sock.close()
            raise TransferError(f"channel {key!r} did not open: {err}") from err
        return IpcChannel(_data_socket(sock), ring, self.device, key, sending=False)


def _from_this_host(sock: socket.socket) -> bool:
    try:
        return same_host(sock.getpeername()[0], sock.getsockname()[0])
    except OSError:  # gone since it spoke
        return False


def same_host(peer: str, local: str) -> bool:
    """Whether a connection that arrived at address `local` from `peer` came from this host:
    over loopback, or from the very address it reached (a process of this host connecting to
    one of the host's own addresses speaks from it)."""

    def plain(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # (an IPv6 zone, if any)
        return getattr(ip, "ipv4_mapped", None) or ip

    peer_ip = plain(peer)
    return peer_ip.is_loopback or peer_ip == plain(local)


def _data_socket(sock: socket.socket) -> socket.socket:
    """Blocking from now on (the channel's deadlines are its waiters'), no Nagle delay."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    keep_alive(sock)
    return sock


@register("ipc")
def _ipc(device: torch.device) -> IpcTransport:
    return IpcTransport(device)
