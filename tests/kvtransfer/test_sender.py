"""KVSender over an in-memory transport: what reaches the wire, in what order, and what each
request's on_finished reports, when sends succeed, fail, or the request is aborted."""

from __future__ import annotations

import functools
import socket
import threading
import time
from typing import NamedTuple

import pytest
import torch

from kvtransfer.integrity import DIGEST_START, fold, part_sums, payload_sum
from kvtransfer.lane import WINDOW, SendRecord
from kvtransfer.sender import KVSender
from kvtransfer.transport import TransferError
from kvtransfer.wire import (
    FRAME_BYTES,
    AbortFrame,
    CloseFrame,
    DoneFrame,
    Frame,
    StepFrame,
    recv_frame,
)
from protocol.kv import Endpoint, KVLayout, Ticket

NUM_LAYERS = 10  # a payload per layer: more payloads a step than WINDOW
LAYOUT = KVLayout(num_layers=NUM_LAYERS, kv_heads=2, head_dim=4, dtype="float32")
TO_D0, TO_D1 = "p0->d0#0", "p0->d1#0"


class FakePending:
    def __init__(self, error: TransferError | None, hangs: bool = False) -> None:
        self.error = error
        self.hangs = hangs  # a send to a killed peer: nothing completes it before the deadline

    def wait(self, timeout: float | None) -> None:
        if self.hangs:
            time.sleep(timeout or 0.0)
            raise TransferError(f"no completion in {timeout} s")
        if self.error is not None:
            raise self.error


class FakeChannel:
    """Keeps a copy of each tensor posted and completes it at once. From its `break_at`-th send
    on (counting from 0) it is broken: sends raise when posted (`on_post`) or when waited on."""

    def __init__(self, break_at: int | None, on_post: bool, hangs: bool = False) -> None:
        self.posted: list[torch.Tensor] = []
        self.break_at = break_at
        self.on_post = on_post
        self.hangs = hangs
        self.broken = False
        self.closed = False

    def send_async(self, tensor: torch.Tensor) -> FakePending:
        self.broken = self.broken or len(self.posted) == self.break_at
        if self.broken and self.on_post:
            raise TransferError("peer went away")
        self.posted.append(tensor.clone())
        return FakePending(TransferError("peer went away") if self.broken else None, self.hangs)

    def send(self, tensor: torch.Tensor, timeout: float) -> None:
        self.send_async(tensor).wait(timeout)

    def recv(self, tensor: torch.Tensor, timeout: float | None) -> None:
        raise NotImplementedError("sending side only")

    def recv_async(self, tensor: torch.Tensor) -> FakePending:
        raise NotImplementedError("sending side only")

    def close(self) -> None:
        self.closed = True


class FakeTransport:
    """Connects to FakeChannels; `break_at[key]` breaks that channel, `refuse` keys never open."""

    name = "fake"

    def __init__(
        self,
        break_at: dict[str, int] | None = None,
        on_post: bool = False,
        refuse: frozenset[str] = frozenset(),
        hang: frozenset[str] = frozenset(),
        slow_connect: dict[str, float] | None = None,
    ) -> None:
        """`hang` keys: every send on them hangs until the sender's deadline; `slow_connect`
        keys take that many seconds to refuse (a decode worker killed as it was dialled)."""
        self.break_at = break_at or {}
        self.on_post = on_post
        self.refuse = refuse
        self.hang = hang
        self.slow_connect = slow_connect or {}
        self.channels: dict[str, FakeChannel] = {}
        self.connects: list[str] = []

    def connect(self, rendezvous: Endpoint, key: str, timeout: float) -> FakeChannel:
        self.connects.append(key)
        if key in self.slow_connect:
            time.sleep(self.slow_connect[key])
            raise TransferError(f"{key} did not answer")
        if key in self.refuse:
            raise TransferError(f"nobody accepted {key}")
        self.channels[key] = FakeChannel(self.break_at.get(key), self.on_post, key in self.hang)
        return self.channels[key]

    def accept(self, rendezvous: object, key: str, timeout: float) -> FakeChannel:
        raise NotImplementedError("sending side only")


class Replay:
    """One posted frame tensor, played back as a receive so wire's own reader decodes it."""

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw

    def recv_async(self, tensor: torch.Tensor) -> FakePending:
        tensor.copy_(self.raw)
        return FakePending(None)


class Finished(NamedTuple):
    request_id: str
    record: SendRecord
    error: TransferError | None


def ticket(request_id: str, num_tokens: int, channel_key: str = TO_D0) -> Ticket:
    decode_id = channel_key.split("->")[1].split("#")[0]
    rendezvous = Endpoint("127.0.0.1", 1)
    return Ticket(request_id, decode_id, rendezvous, channel_key, 0, num_tokens, LAYOUT, 30.0)


def payload(value: float, num_tokens: int) -> torch.Tensor:
    # [2, num_tokens, kv_heads, head_dim]
    return torch.full((2, num_tokens, LAYOUT.kv_heads, LAYOUT.head_dim), value)


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def start_sender(transport: FakeTransport, timeout: float = 1.0) -> tuple[KVSender, list[Finished]]:
    finished: list[Finished] = []
    sender = KVSender(transport, timeout, lambda *report: finished.append(Finished(*report)))
    return sender, finished


def wire(channel: FakeChannel) -> list[Frame | torch.Tensor]:
    """What the channel carried: frames decoded, payloads as posted."""
    is_frame = [t.dtype == torch.uint8 and t.numel() == FRAME_BYTES for t in channel.posted]
    return [
        recv_frame(Replay(t), 1.0) if frame else t
        for t, frame in zip(channel.posted, is_frame, strict=True)
    ]


def send_step(sender: KVSender, tickets: list[Ticket], value: float = 0.0) -> list[torch.Tensor]:
    """Announces one step of whole prompts and sends every layer, the prompts' tokens back to
    back in one payload a layer; returns the payloads sent."""
    sender.send_step([(t, 0, t.num_tokens) for t in tickets], NUM_LAYERS)
    parts = [(t, t.num_tokens) for t in tickets]
    sent = []
    for layer in range(NUM_LAYERS):
        sent.append(payload(value + len(sent), sum(t.num_tokens for t in tickets)))
        sender.send_layer(parts, layer, sent[-1])
    return sent


def part(payloads: list[torch.Tensor], start: int, num_tokens: int) -> list[torch.Tensor]:
    """One request's tokens of each payload, as it would be packed alone."""
    return [p[:, start : start + num_tokens].contiguous() for p in payloads]


def test_posts_frames_and_payloads_in_submission_order() -> None:
    a, b = ticket("A", 3), ticket("B", 2)
    transport = FakeTransport()
    sender, finished = start_sender(transport)
    sender.open(a)
    sender.open(b)
    payloads = send_step(sender, [a, b])
    sender.send_done(a, 11, None)
    sender.send_done(b, 12, None)
    sender.close()

    assert len(payloads) == NUM_LAYERS > WINDOW  # one payload a layer for both requests
    assert transport.connects == [TO_D0]  # one channel, opened once, for both tickets
    stream = wire(transport.channels[TO_D0])
    assert stream[0] == StepFrame([["A", 0, 3], ["B", 0, 2]], NUM_LAYERS)
    assert len(stream) == 1 + len(payloads) + 2 + 1
    assert stream[-1] == CloseFrame("the prefill worker stopped sending")  # close() says so
    stream = stream[:-1]
    for got, want in zip(stream[1:-2], payloads, strict=True):
        assert torch.equal(got, want)
    # Each done frame carries the digest of its own request's parts, in send order: the sums
    # it would have had packed alone.
    mine = (part(payloads, 0, 3), part(payloads, 3, 2))
    digests = [functools.reduce(fold, map(payload_sum, parts), DIGEST_START) for parts in mine]
    assert stream[-2:] == [
        DoneFrame("A", 11, None, None, digests[0]),
        DoneFrame("B", 12, None, None, digests[1]),
    ]

    assert [(f.request_id, f.error) for f in finished] == [("A", None), ("B", None)]
    for report, sent in zip(finished, mine, strict=True):
        assert report.record.bytes_sent == nbytes(sent)
        assert [layer for layer, _, _ in report.record.layer_sends] == list(range(NUM_LAYERS))
        assert report.record.seconds >= 0 and report.record.finished is not None


@pytest.mark.parametrize("on_post", [True, False], ids=["post-raises", "wait-raises"])
def test_failed_send_reports_once_and_skips_the_request(on_post: bool) -> None:
    a, b = ticket("A", 3, TO_D0), ticket("B", 2, TO_D1)
    transport = FakeTransport(break_at={TO_D0: 2}, on_post=on_post)  # A's layer 1 payload
    sender, finished = start_sender(transport)
    for t in (a, b):
        sender.open(t)
    send_step(sender, [a])
    b_payloads = send_step(sender, [b])
    sender.send_done(a, 11, None)
    sender.send_done(b, 12, None)
    sender.close()

    assert sorted(transport.connects) == [TO_D0, TO_D1]  # the broken channel is not reopened
    assert transport.channels[TO_D0].closed
    reports = {f.request_id: f for f in finished}
    assert len(finished) == 2 and set(reports) == {"A", "B"}
    assert isinstance(reports["A"].error, TransferError)
    assert reports["B"].error is None
    assert reports["B"].record.bytes_sent == nbytes(b_payloads)
    if on_post:  # the failure is seen at once: nothing of A's follows it onto the wire
        assert len(transport.channels[TO_D0].posted) == 2


def test_broken_step_frame_fails_each_request_it_names_once() -> None:
    a, b = ticket("A", 3), ticket("B", 2)
    transport = FakeTransport(break_at={TO_D0: 0}, on_post=True)
    sender, finished = start_sender(transport)
    send_step(sender, [a, b])
    sender.send_done(a, 11, None)
    sender.send_done(b, 12, None)
    sender.close()

    assert sorted(f.request_id for f in finished) == ["A", "B"]
    assert all(isinstance(f.error, TransferError) for f in finished)
    assert transport.channels[TO_D0].posted == []


def test_unreachable_decode_worker_fails_once() -> None:
    a = ticket("A", 3)
    transport = FakeTransport(refuse=frozenset({TO_D0}))
    sender, finished = start_sender(transport)
    sender.open(a)
    send_step(sender, [a])
    sender.send_done(a, 11, None)
    sender.close()

    assert transport.connects == [TO_D0]
    assert [(f.request_id, type(f.error)) for f in finished] == [("A", TransferError)]
    assert finished[0].record.bytes_sent == 0


def test_abort_frame_reports_a_transfer_error() -> None:
    a = ticket("A", 3)
    transport = FakeTransport()
    sender, finished = start_sender(transport)
    sender.open(a)
    sent = payload(1.0, 3)
    sender.send_layer([(a, 3)], 0, sent)
    sender.send_abort(a, "client went away")
    sender.close()

    stream = wire(transport.channels[TO_D0])
    assert torch.equal(stream[0], sent)
    assert stream[1:] == [
        AbortFrame("A", "client went away"),
        CloseFrame("the prefill worker stopped sending"),
    ]
    [report] = finished
    assert report.request_id == "A"
    assert isinstance(report.error, TransferError) and str(report.error) == "client went away"
    assert report.record.bytes_sent == nbytes([sent])


def test_a_dead_peer_costs_one_deadline_not_one_per_send_in_flight() -> None:
    """Every send to D0 hangs (its decode worker was killed): the first one waited on times out
    and fails A; the other sends A had in flight are not waited on again, so B, on D1, is sent
    and reported one deadline later, not WINDOW deadlines later."""
    a, b = ticket("A", 3, TO_D0), ticket("B", 2, TO_D1)
    transport = FakeTransport(hang=frozenset({TO_D0}))
    deadline = 0.3
    sender, finished = start_sender(transport, timeout=deadline)
    started = time.monotonic()
    send_step(sender, [a])  # 1 frame + 10 payloads, WINDOW of them in flight on D0
    send_step(sender, [b])
    sender.send_done(a, 11, None)
    sender.send_done(b, 12, None)
    sender.close(timeout=WINDOW * deadline + 5)
    elapsed = time.monotonic() - started

    reports = {f.request_id: f for f in finished}
    assert isinstance(reports["A"].error, TransferError) and reports["B"].error is None
    assert len(finished) == 2
    assert deadline <= elapsed < 2.5 * deadline  # was one deadline per send in flight: ~7x


def test_a_channel_still_connecting_holds_up_no_other() -> None:
    """D0 was killed as its channel was being opened: the connect takes seconds to fail. B, on
    D1, is sent meanwhile (with one thread for every channel it waited for that connect, and
    every request on every decode worker expired behind it)."""
    a, b = ticket("A", 3, TO_D0), ticket("B", 2, TO_D1)
    connect_s = 1.0
    transport = FakeTransport(slow_connect={TO_D0: connect_s})
    finished: list[Finished] = []
    reported: dict[str, float] = {}

    def on_finished(request_id: str, record: SendRecord, error: TransferError | None) -> None:
        reported[request_id] = time.monotonic()
        finished.append(Finished(request_id, record, error))

    sender = KVSender(transport, 1.0, on_finished)
    started = time.monotonic()
    sender.open(a)
    sender.open(b)
    send_step(sender, [a])
    send_step(sender, [b])
    sender.send_done(a, 11, None)
    sender.send_done(b, 12, None)
    sender.close(timeout=connect_s + 5)

    reports = {f.request_id: f for f in finished}
    assert reports["B"].error is None and isinstance(reports["A"].error, TransferError)
    assert reported["B"] - started < connect_s / 2 <= connect_s <= reported["A"] - started
    assert transport.connects.count(TO_D0) == 1  # A's later jobs fail without dialling again


def lane_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kv-send-")}


def test_forgetting_a_decode_worker_closes_its_lane_after_what_was_queued() -> None:
    a, b = ticket("A", 3, TO_D0), ticket("B", 2, TO_D1)
    transport = FakeTransport()
    sender, finished = start_sender(transport)
    a_payloads = send_step(sender, [a])
    sender.send_done(a, 11, None)
    send_step(sender, [b])
    sender.forget_peer("d0")
    late = ticket("C", 4, TO_D0)  # a job for it after it left
    sender.open(late)
    sender.send_done(b, 12, None)
    deadline = time.monotonic() + 5
    # (d1's lane dials when it takes its first job: on a busy machine, after d0's lane is gone)
    while (
        f"kv-send-{TO_D0}" in lane_threads() or TO_D1 not in transport.channels
    ) and time.monotonic() < deadline:
        time.sleep(0.01)

    assert f"kv-send-{TO_D0}" not in lane_threads() and f"kv-send-{TO_D1}" in lane_threads()
    assert transport.channels[TO_D0].closed and not transport.channels[TO_D1].closed
    assert transport.connects.count(TO_D0) == 1  # C's job failed without dialling again
    sender.close()
    reports = {f.request_id: f for f in finished}
    assert reports["A"].error is None and reports["A"].record.bytes_sent == nbytes(a_payloads)
    assert reports["B"].error is None
    assert isinstance(reports["C"].error, TransferError)
    assert transport.channels[TO_D1].closed  # close() closes every lane's channel


def test_part_sums_are_each_part_packed_alone() -> None:
    whole = torch.randn(2, 9, LAYOUT.kv_heads, LAYOUT.head_dim).to(torch.bfloat16)
    sizes = [4, 1, 0, 4]
    starts = [0, 4, 5, 5]
    want = [payload_sum(p) for s, n in zip(starts, sizes, strict=True) for p in part([whole], s, n)]
    assert part_sums(whole, sizes) == want


def test_over_gloo_a_decode_worker_that_never_answers_holds_up_no_other() -> None:
    """The failure CI saw, on the real transport: D0's rendezvous accepts the connection and
    never answers (a worker frozen as it is dialled: TCPStore alone would wait for good); B's
    transfer to D1 goes through meanwhile, and A fails one deadline (and a grace) later."""
    from kvtransfer.transport import DIAL_GRACE_S, Rendezvous, make_transport

    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    rendezvous = Rendezvous("127.0.0.1")
    to_d0 = ticket("A", 3, TO_D0)._replace(
        rendezvous=Endpoint("127.0.0.1", silent.getsockname()[1])
    )
    to_d1 = ticket("B", 2, TO_D1)._replace(rendezvous=rendezvous.endpoint)
    transport = make_transport("gloo", torch.device("cpu"))
    received: dict[str, object] = {}

    def receive() -> None:
        channel = transport.accept(rendezvous.store, TO_D1, 10.0)
        received["step"] = recv_frame(channel, 10.0)
        payloads = [torch.empty(2, 2, LAYOUT.kv_heads, LAYOUT.head_dim) for _ in range(NUM_LAYERS)]
        for tensor in payloads:
            channel.recv(tensor, 10.0)
        received["payloads"] = payloads
        received["done"] = recv_frame(channel, 10.0)
        received["at"] = time.monotonic()

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    deadline = 2.0
    sender, finished = start_sender(transport, timeout=deadline)  # type: ignore[arg-type]
    started = time.monotonic()
    try:
        sender.open(to_d0)
        send_step(sender, [to_d0])
        sender.send_done(to_d0, 11, None)
        sent = send_step(sender, [to_d1], value=5.0)
        sender.send_done(to_d1, 12, None)
        receiver.join(deadline)
        assert not receiver.is_alive(), "D1's transfer waited behind D0's dial"
        assert received["at"] - started < deadline / 2
        assert all(torch.equal(a, b) for a, b in zip(received["payloads"], sent, strict=True))
        assert received["done"].request_id == "B"
        sender.close(timeout=deadline + DIAL_GRACE_S + 5)
        reports = {f.request_id: f for f in finished}
        assert reports["B"].error is None
        assert "did not answer" in str(reports["A"].error)
        assert time.monotonic() - started < deadline + DIAL_GRACE_S + 2
    finally:
        silent.close()


def test_a_new_channel_key_to_a_decode_worker_closes_its_old_lane() -> None:
    """D0's receiver gave up the old channel on its side and handed out a new key: the lane
    under the old key, which nothing would send on again, closes when the new one opens."""
    old, new = ticket("A", 3, "p0->d0#0"), ticket("B", 2, "p0->d0#1")
    transport = FakeTransport()
    sender, finished = start_sender(transport)
    send_step(sender, [old])
    sender.send_done(old, 11, None)
    deadline = time.monotonic() + 5
    while not finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane_threads() >= {"kv-send-p0->d0#0"}
    send_step(sender, [new])
    sender.send_done(new, 12, None)
    while "kv-send-p0->d0#0" in lane_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "kv-send-p0->d0#0" not in lane_threads() and sender.open_lanes == 1
    assert transport.channels["p0->d0#0"].closed
    assert wire(transport.channels["p0->d0#0"])[-1] == CloseFrame("channel p0->d0#1 replaced it")
    sender.close()
    assert [(f.request_id, f.error) for f in finished] == [("A", None), ("B", None)]


def send_each(transport: FakeTransport, tickets: list[Ticket]) -> list[Finished]:
    """Each ticket's whole prompt in a step of its own, in this order, then its done frame;
    what every request reported, once all have."""
    sender, finished = start_sender(transport)
    for t in tickets:
        send_step(sender, [t])
        sender.send_done(t, 11, None)
    deadline = time.monotonic() + 5
    while len(finished) < len(tickets) and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.close()
    return finished


def test_an_older_key_that_arrives_after_the_live_one_fails_alone() -> None:
    """D0 gave up key #0 and gave B the new #1 while A's prefill, reserved under #0, was on its
    way: B's ticket came first. A's old key gets no lane, and the live lane stays open for the
    requests after it."""
    old, new, later = (
        ticket("A", 2, "p0->d0#0"),
        ticket("B", 2, "p0->d0#1"),
        ticket("C", 2, "p0->d0#1"),
    )
    transport = FakeTransport()
    finished = send_each(transport, [new, old, later])
    errors = {f.request_id: f.error and str(f.error) for f in finished}
    assert errors == {"A": "channel p0->d0#0 broke or was replaced earlier", "B": None, "C": None}
    assert transport.connects == ["p0->d0#1"]  # no channel was opened for the old key


def test_keys_of_two_receivers_leave_each_others_lanes_open() -> None:
    """A decode worker that left and came back has a new receiver (its rendezvous port names
    it): keys of the two have no order, so a late ticket of the old one closes nothing."""
    back, gone = (
        ticket(r, 2, key)._replace(decode_id="d0")
        for r, key in (("B", "p0->d0:2#0"), ("A", "p0->d0:1#3"))
    )
    transport = FakeTransport(refuse=frozenset({"p0->d0:1#3"}))
    finished = send_each(transport, [back, gone, back._replace(request_id="C")])
    errors = {f.request_id: f.error is not None for f in finished}
    assert errors == {"A": True, "B": False, "C": False}


@pytest.mark.parametrize("where", ["post", "wait"])
def test_an_unexpected_error_breaks_the_channel_and_the_lane_serves_on(
    where: str, monkeypatch
) -> None:
    """Not a TransferError (a CUDA error staging a payload, a UCX error while waiting): the
    request on that channel fails at once, later jobs on it are refused, and another channel's
    request goes through; before, the lane's thread died and its requests waited for good."""
    import kvtransfer.lane

    a, b = ticket("A", 3, TO_D0), ticket("B", 2, TO_D1)
    transport = FakeTransport()
    sender, finished = start_sender(transport)
    for t in (a, b):
        sender.open(t)
    if where == "post":

        def staging_fails(payload: torch.Tensor, counts: list[int]) -> list[int]:
            if counts == [a.num_tokens]:  # A's payloads only (B has 2 tokens)
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return part_sums(payload, counts)

        monkeypatch.setattr(kvtransfer.lane, "part_sums", staging_fails)
        send_step(sender, [a])
    else:  # A's channel fails a wait with an error that is not a TransferError
        sender.send_step([(a, 0, 3)], NUM_LAYERS)
        deadline = time.monotonic() + 5
        while TO_D0 not in transport.channels:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        original = FakeChannel.send_async

        def wait_fails(self: FakeChannel, tensor: torch.Tensor) -> FakePending:
            pending = original(self, tensor)
            pending.error = ValueError("ucp error") if self is transport.channels[TO_D0] else None
            return pending

        monkeypatch.setattr(FakeChannel, "send_async", wait_fails)
        for layer in range(NUM_LAYERS):
            sender.send_layer([(a, 3)], layer, payload(1.0, 3))
    b_payloads = send_step(sender, [b])
    sender.send_done(a, 11, None)
    sender.send_done(b, 12, None)
    sender.close(timeout=5)

    reports = {f.request_id: f for f in finished}
    assert len(finished) == 2
    # (the error is the unexpected one, or "broke earlier" when it first hit the step frame's
    # send, which speaks for no request: either way A fails at once)
    assert isinstance(reports["A"].error, TransferError)
    assert reports["B"].error is None and reports["B"].record.bytes_sent == nbytes(b_payloads)
    assert transport.channels[TO_D0].closed
