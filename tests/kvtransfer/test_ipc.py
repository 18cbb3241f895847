"""The ipc transport's own rules (its Channel contract runs with every transport's, in
test_transports.py): a pair on two devices or hosts opens its fallback's channel instead, or fails
clearly without one; `auto` picks it on CUDA; the shared file is gone once the channel is open;
a message larger than the ring goes through it piece by piece."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import kvtransfer.ipc as ipc
from kvtransfer.ipc import IpcChannel, IpcTransport
from kvtransfer.torch_dist import ProcessGroupChannel
from kvtransfer.transport import Rendezvous, TransferError, make_transport

CPU = torch.device("cpu")


def open_pair(sending, receiving, accepted: dict | None = None, key: str = "p0->d0#0"):
    """(sending channel, {"rx": receiving channel} or {"error": why the accept failed})."""
    rendezvous, accepted = Rendezvous("127.0.0.1"), {} if accepted is None else accepted

    def accept() -> None:
        try:
            accepted["rx"] = receiving.accept(rendezvous.store, key, 20)
        except TransferError as err:
            accepted["error"] = err

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        tx = sending.connect(rendezvous.endpoint, key, 20)
    finally:
        thread.join(20)
    return tx, accepted


@pytest.fixture
def two_devices(monkeypatch):
    """Each thread reads as its own device: the accepting thread and the connecting one."""
    monkeypatch.setattr(ipc, "_device_id", lambda device: threading.current_thread().name)


def test_a_pair_on_two_devices_opens_the_fallbacks_channel(two_devices) -> None:
    gloo = make_transport("gloo", CPU)
    tx, accepted = open_pair(IpcTransport(CPU, fallback=gloo), IpcTransport(CPU, fallback=gloo))
    rx = accepted["rx"]
    assert isinstance(tx, ProcessGroupChannel) and isinstance(rx, ProcessGroupChannel)
    sent, got = torch.arange(100, dtype=torch.int64), torch.empty(100, dtype=torch.int64)
    pending = rx.recv_async(got)
    tx.send(sent, 10)
    pending.wait(10)
    assert torch.equal(got, sent)
    tx.close(), rx.close()


def test_without_a_fallback_a_pair_on_two_devices_is_a_clear_error_on_both_sides(
    two_devices,
) -> None:
    start = time.monotonic()
    with pytest.raises(TransferError, match="one host and one device"):
        open_pair(IpcTransport(CPU), IpcTransport(CPU), accepted := {})
    assert "another host or device" in str(accepted["error"])
    assert time.monotonic() - start < 5  # the accepting side is told, not left to time out


def test_auto_is_ipc_with_nccl_between_devices_on_cuda_and_gloo_on_cpu() -> None:
    assert make_transport("auto", torch.device("cuda")).name == "ipc/nccl"
    assert make_transport("auto", CPU).name == "gloo"


def test_the_shared_file_is_gone_once_the_channel_is_open(monkeypatch) -> None:
    made = []
    lend = ipc._lend_ring

    def recording(*args):
        ring, lent = lend(*args)
        made.append(lent["path"])
        return ring, lent

    monkeypatch.setattr(ipc, "_lend_ring", recording)
    tx, accepted = open_pair(IpcTransport(CPU), IpcTransport(CPU))
    assert isinstance(tx, IpcChannel)
    assert made and not os.path.exists(made[0])
    tx.close(), accepted["rx"].close()


def test_no_room_for_the_ring_is_a_clear_error_on_both_sides_and_leaves_no_file(
    monkeypatch, tmp_path
) -> None:
    """The ring's file cannot be sized (a full /dev/shm, say): the sender fails at once, the
    receiver hears of it rather than waiting out its deadline, and no file is left behind."""
    monkeypatch.setattr(ipc.os.path, "isdir", lambda path: False)
    monkeypatch.setattr(ipc.tempfile, "gettempdir", lambda: str(tmp_path))

    def full(fd: int, *sizes: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ipc.os, "ftruncate", full)
    monkeypatch.setattr(ipc.os, "posix_fallocate", full)
    start = time.monotonic()
    with pytest.raises(TransferError, match="no ring"):
        open_pair(IpcTransport(CPU), IpcTransport(CPU), accepted := {})
    assert "did not open" in str(accepted["error"])
    assert time.monotonic() - start < 5
    assert list(tmp_path.iterdir()) == []


def test_an_empty_message_arrives() -> None:
    tx, accepted = open_pair(IpcTransport(CPU), IpcTransport(CPU))
    rx = accepted["rx"]
    empty, after = torch.empty(0, dtype=torch.uint8), torch.arange(10, dtype=torch.uint8)
    got_empty, got_after = torch.empty(0, dtype=torch.uint8), torch.empty(10, dtype=torch.uint8)
    posted = [rx.recv_async(got_empty), rx.recv_async(got_after)]
    for op in [tx.send_async(empty), tx.send_async(after), *posted]:
        op.wait(10)
    assert torch.equal(got_after, after)
    tx.close(), rx.close()


def test_only_this_host_may_offer_a_ring() -> None:
    assert ipc.same_host("127.0.0.1", "127.0.0.1")
    assert ipc.same_host("::1", "::1")
    assert ipc.same_host("::ffff:127.0.0.1", "::ffff:127.0.0.1")
    assert ipc.same_host("10.0.0.5", "10.0.0.5")  # this host, through its own address
    assert ipc.same_host("::ffff:10.0.0.5", "10.0.0.5")
    assert not ipc.same_host("10.0.0.7", "10.0.0.5")
    assert not ipc.same_host("::ffff:10.0.0.7", "::ffff:10.0.0.5")


def test_a_ring_offered_from_another_host_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(ipc, "same_host", lambda peer, local: False)
    start = time.monotonic()
    with pytest.raises(TransferError, match="did not open"):
        open_pair(IpcTransport(CPU), IpcTransport(CPU), accepted := {})
    assert "from another host, refused" in str(accepted["error"])
    assert time.monotonic() - start < 5


def test_a_message_larger_than_the_ring_arrives_whole() -> None:
    """Three slots of 1 MiB and messages of up to 7.5 MiB: the sender waits for slots the
    receiver empties; pieces and messages stay in order."""
    transport = IpcTransport(CPU, slots=3, slot_bytes=1 << 20)
    tx, accepted = open_pair(transport, IpcTransport(CPU, slots=3, slot_bytes=1 << 20))
    rx = accepted["rx"]
    sent = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (15 << 19, 100, 3 << 20)]
    targets = [torch.empty_like(t) for t in sent]
    posted = [rx.recv_async(t) for t in targets]
    for op in [*(tx.send_async(t) for t in sent), *posted]:
        op.wait(10)
    assert all(torch.equal(a, b) for a, b in zip(targets, sent, strict=True))
    tx.close(), rx.close()


def test_a_lost_message_breaks_the_channel_and_a_duplicate_is_dropped() -> None:
    tx, accepted = open_pair(IpcTransport(CPU), IpcTransport(CPU))
    rx = accepted["rx"]
    first, again = torch.full((8,), 1), torch.full((8,), 2)
    tx.send_async(first)
    tx.send_again(again)  # a duplicate of message 0: read and dropped
    tx.send_async(torch.full((8,), 3))
    got = torch.empty(8, dtype=torch.int64)
    rx.recv(got, 10)
    assert got.tolist() == [1] * 8
    rx.recv(got, 10)
    assert got.tolist() == [3] * 8
    tx.skip_message()
    tx.send_async(torch.full((8,), 4))
    with pytest.raises(TransferError, match="lost"):
        rx.recv(got, 10)
    with pytest.raises(TransferError, match="broken"):
        rx.recv_async(got)
    tx.close(), rx.close()


def test_the_cuda_auto_is_made_again_by_its_name() -> None:
    """Tensor-parallel followers make their transport from the leader's `transport.name`."""
    cuda = torch.device("cuda")
    assert make_transport(make_transport("auto", cuda).name, cuda).name == "ipc/nccl"


def test_a_lent_receive_reads_the_slot_in_place_and_frees_it_in_order() -> None:
    """Two slots; messages 0 and 1 lent, message 2 copied. Message 2 cannot go out while both
    slots are lent; releasing the newer one alone frees nothing (slots are refilled oldest
    first); releasing the older frees both."""
    tx, accepted = open_pair(IpcTransport(CPU, slots=2, slot_bytes=1 << 20), IpcTransport(CPU))
    rx = accepted["rx"]
    sent = [torch.randn(2, 512, 4, 64) for _ in range(3)]  # 1 MiB each: one slot
    first = rx.recv_lent_async((2, 512, 4, 64), torch.float32)
    second = rx.recv_lent_async((2, 512, 4, 64), torch.float32)
    assert rx.recv_lent_async((2, 1024, 4, 64), torch.float32) is None  # two slots: copied
    third = torch.empty_like(sent[2])
    rx.recv_async(third)
    sends = [tx.send_async(t) for t in sent]
    for op in (*sends[:2], first, second):
        op.wait(10)
    assert torch.equal(first.tensor, sent[0]) and torch.equal(second.tensor, sent[1])
    assert first.tensor.data_ptr() != second.tensor.data_ptr()
    second.release()
    with pytest.raises(TransferError):  # no slot free yet: the third send waits
        sends[2].wait(0.3)
    tx.close(), rx.close()


def test_a_lent_receive_lets_the_sender_go_on_once_released() -> None:
    tx, accepted = open_pair(IpcTransport(CPU, slots=2, slot_bytes=1 << 20), IpcTransport(CPU))
    rx = accepted["rx"]
    sent = [torch.full((2, 512, 4, 64), float(i)) for i in range(6)]
    sends = [tx.send_async(t) for t in sent]
    for i, want in enumerate(sent):
        lent = rx.recv_lent_async(tuple(want.shape), torch.float32)
        lent.wait(10)
        assert torch.equal(lent.tensor, want), i
        lent.release()
    for op in sends:
        op.wait(10)
    tx.close(), rx.close()
