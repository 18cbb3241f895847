"""The plain TCP side of the channels that carry their bytes elsewhere (UCX, CUDA IPC): the
offer a decode worker leaves in its store, a listener, and length-prefixed handshake messages."""

from __future__ import annotations

import socket
import struct
import time

import msgpack

from kvtransfer.transport import TransferError, dial_store
from protocol.kv import Endpoint


def read_offer(rendezvous: Endpoint, key: str, timeout: float) -> dict:
    """What the accepting side left in its store under `key` (msgpack), waited for."""
    store = dial_store(rendezvous, timeout)
    try:
        return msgpack.unpackb(store.get(key))
    except RuntimeError as err:  # no accept in time
        raise TransferError(f"channel {key!r}: no offer at {rendezvous}: {err}") from err


def listener() -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


def keep_alive(sock: socket.socket) -> None:
    """A peer host that vanishes without closing the connection is noticed in ~10 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 4)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def send_message(sock: socket.socket, body: bytes, deadline: float) -> None:
    sock.settimeout(left(deadline))
    sock.sendall(struct.pack("<I", len(body)) + body)


def recv_message(sock: socket.socket, deadline: float) -> bytes:
    sock.settimeout(left(deadline))
    (length,) = struct.unpack("<I", recv_exactly(sock, 4))
    return recv_exactly(sock, length)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes (read into one buffer); TransferError if the peer closes first."""
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        size = sock.recv_into(view[got:])
        if size == 0:
            raise TransferError("the peer closed the connection")
        got += size
    return bytes(buffer)


def left(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError("timed out opening the channel")
    return remaining
