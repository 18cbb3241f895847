"""DecodeWorker: reserves blocks, receives KV into them, and decodes with continuous batching.

    reserve(request, prefill_id) -> Ticket     blocks for every token, minus its prefix-cache hits
    KVReceiver thread                          layers land in the reserved blocks
    Arrived (all layers + first token)         the request joins the running batch
    each engine step                           new tokens of every request -> one batch of updates,
                                               pushed to the coordinator (decode/publisher.py)
    add_local(request)                         short prompts: prefilled here, chunked into steps

A reservation is a lease: if its KV has not arrived within the ticket's timeout, its blocks are
freed and the coordinator hears of it.

Tensor parallel: this is rank 0. Every rank receives the KV heads it holds on its own legs
(protocol/kv.py routes); the follower ranks hear of each reservation before its ticket leaves,
and report each arrival here (worker/rank_roles.py). A request joins the batch once every rank
has all of its heads; a failure on any rank fails the transfer.

Threads: the engine thread owns the engine, the leases and the counters; the receiver thread
hands each finished transfer to it with `submit`, and updates leave through `_updates` under
its condition, taken by the publisher's thread. A plain class (no Ray); `worker.actor` wraps it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from decode.publisher import UpdatePublisher
from engine.block_manager import slots_of
from engine.engine import LLMEngine, Reservation
from engine.engine_thread import EngineThread
from kvtransfer.receiver import Arrived, KVReceiver, Leg, ReceiveEvent, TransferFailed
from kvtransfer.transport import Rendezvous, Transport
from protocol.kv import Endpoint, Ticket
from protocol.messages import RequestFailed, WorkerUpdate, WorkRequest
from protocol.sampling import TokenLogprobs
from protocol.stats import TransferCounters, WorkerStats

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        transport: Transport,
        transfer_timeout: float,
        host: str = "127.0.0.1",
        verify_kv: bool = True,
        num_threads: int | None = None,
        pace: Callable[[bool], None] | None = None,
    ) -> None:
        """Serves `engine` (idle, owned by no thread yet) until shutdown(), which leaves it
        idle again for another role. `verify_kv`: tickets ask for the KV's checksums.
        `num_threads`: the engine thread's cores (default: the caller's torch thread count);
        `pace`: what may change them between steps (EngineThread), and between the layers of
        a step: a prefill worker that starts a step beside ours takes its share at once."""
        self.worker_id = worker_id
        self.verify_kv = verify_kv
        self.engine = engine
        self.transfer_timeout = transfer_timeout
        self.layout = self.engine.kv_layout
        self.rendezvous = Rendezvous(host)
        self.receiver = KVReceiver(
            transport,
            self.rendezvous,
            self.engine.kv_caches,
            worker_id,
            self._on_receive,
            transfer_timeout,
        )
        self.ranks = engine.runner.ranks  # the follower ranks, under tensor parallelism
        self.num_ranks = engine.config.tensor_parallel_size
        if self.ranks is not None:  # each receives its own heads, on the same rendezvous
            self.ranks.on_event = self._on_rank_event
            endpoint = self.rendezvous.endpoint
            self.ranks.call(["decode", transport.name, endpoint, worker_id, transfer_timeout])
        self._arriving: dict[str, dict[int, Arrived]] = {}  # request -> ranks' arrivals so far
        self.route_bytes: dict[str, int] = {}  # "src>dst" -> KV bytes received on that route
        self._follower_bytes = 0  # what the follower ranks received, for arrived requests
        # reserved request -> (monotonic deadline, the lease's seconds)
        self._leases: dict[str, tuple[float, float]] = {}
        self._updates: list[WorkerUpdate] = []
        self._updates_ready = threading.Condition()
        self.transfers = TransferCounters(transport.name)
        self.prefilled_locally = 0
        self.publisher: UpdatePublisher | None = None
        # A decode step that began on every core while the prefill worker idled would keep them
        # all to its end, and a prefill step starting beside it puts three threads on two
        # cores: every parallel region then waits for a preempted thread (measured: such
        # decode steps took twice their time, and made the ITL tail). So it re-paces per layer.
        self._on_layer = None if pace is None else lambda plan, layer: pace(True)
        self.thread = EngineThread(
            f"decode-{worker_id}",
            self._step,
            lambda: self.engine.has_unfinished,
            self._crashed,
            housekeeping=self._expire_leases,
            num_threads=num_threads,
            pace=pace,
        )

    # -- any thread ------------------------------------------------------------------------

    def reserve(
        self,
        request: WorkRequest,
        prefill_id: str,
        broken_key: str | None = None,
        prefill_tp: int = 1,
        lease_s: float | None = None,
    ) -> Future:
        """Future of a Ticket, or of None when the blocks do not fit now. `broken_key`: a
        channel the prefill worker found broken (a new one is opened if this side has not
        noticed). `prefill_tp`: the prefill worker's ranks (they name the routes). `lease_s`:
        how long the prefill may take, its queue included (the coordinator's deadline for it):
        the reservation is held that long, or the transfer timeout if longer."""
        return self.thread.submit(
            self._reserve, request, prefill_id, broken_key, prefill_tp, lease_s
        )

    def add_local(self, request: WorkRequest) -> Future:
        return self.thread.submit(self._add_local, request)

    def abort(self, request_id: str) -> Future:
        return self.thread.submit(self._abort, request_id)

    def take_updates(self, timeout: float) -> list[WorkerUpdate]:
        """Every update since the last call; waits up to `timeout` seconds for one."""
        with self._updates_ready:
            if not self._updates:
                self._updates_ready.wait(timeout)
            updates, self._updates = self._updates, []
        if self.thread.error is not None and not updates:
            raise RuntimeError(f"decode worker crashed: {self.thread.error}")
        return updates

    def stream_updates(self, endpoint: Endpoint, secret: str) -> None:
        """Pushes every update from now on to the coordinator at `endpoint` (updates published
        before are sent first). A second call replaces the first connection."""
        if self.publisher is not None:
            self.publisher.close()
        self.publisher = UpdatePublisher(self.take_updates, endpoint, self.worker_id, secret)

    def stats(self) -> Future:
        return self.thread.submit(self._stats)

    def shutdown(self) -> None:
        """Stops serving: reservations and running requests are dropped (their KV blocks
        freed), and the engine is left idle. Transfers still arriving are read and discarded."""
        self.thread.stop()
        if self.publisher is not None:
            self.publisher.close()
        for request_id in self.engine.abort_all():
            self.receiver.forget(request_id)
        self._leases.clear()
        self._arriving.clear()
        if self.ranks is not None:
            self.ranks.on_event = None
            with contextlib.suppress(Exception):  # a dead rank ends the worker anyway
                self.ranks.call(["idle"])

    # -- engine thread ---------------------------------------------------------------------

    def _reserve(
        self,
        request: WorkRequest,
        prefill_id: str,
        broken_key: str | None,
        prefill_tp: int,
        lease_s: float | None = None,
    ) -> Ticket | None:
        if not self.engine.has_room(len(self._leases)):
            return None  # the decode batch is full; the coordinator waits or goes elsewhere
        reservation = self.engine.reserve(
            request.request_id, request.prompt_ids, request.params, request.output_ids
        )
        if reservation is None:
            return None
        try:
            lease_s = max(self.transfer_timeout, lease_s or 0.0)
            return self._expect(request, reservation, prefill_id, broken_key, prefill_tp, lease_s)
        except Exception:  # nothing would ever free the blocks of a reservation without a lease
            self._forget(request.request_id)
            self._leases.pop(request.request_id, None)
            self.engine.release(request.request_id)
            raise

    def _expect(
        self,
        request: WorkRequest,
        reservation: Reservation,
        prefill_id: str,
        broken_key: str | None,
        prefill_tp: int,
        lease_s: float,
    ) -> Ticket:
        """The ticket for a reservation made, once every rank expects its KV."""
        num_tokens = len(request.prompt_ids) + len(request.output_ids)
        key = self.receiver.channel_key(prefill_id, broken_key)
        bs = self.engine.config.block_size
        slots = slots_of(reservation.block_table, reservation.num_cached_tokens, num_tokens, bs)
        ticket = Ticket(
            request_id=request.request_id,
            decode_id=self.worker_id,
            rendezvous=self.rendezvous.endpoint,
            channel_key=key,
            num_cached_tokens=reservation.num_cached_tokens,
            num_tokens=num_tokens,
            layout=self.layout,
            timeout=lease_s,
            verify=self.verify_kv,
            prefill_tp=prefill_tp,
            decode_tp=self.num_ranks,
        )
        legs = [Leg(key, range(r.head_start, r.head_stop), r) for key, r in ticket.legs_into(0)]
        self.receiver.expect(
            request.request_id, key, slots, reservation.num_cached_tokens, self.verify_kv, legs
        )
        self._leases[request.request_id] = (time.monotonic() + lease_s, lease_s)
        if self.ranks is not None:  # each rank expects its heads before the ticket leaves
            self.ranks.call(["expect", ticket, slots])
        return ticket

    def _add_local(self, request: WorkRequest) -> None:
        self.engine.add_request(
            request.request_id, request.prompt_ids, request.params, request.output_ids,
            request.age_s,
        )  # fmt: skip
        self.prefilled_locally += 1

    def _abort(self, request_id: str) -> bool:
        self._forget(request_id)
        self._leases.pop(request_id, None)
        return self.engine.abort(request_id)

    def _forget(self, request_id: str) -> None:
        """No rank writes the request's KV any more once this returns."""
        self.receiver.forget(request_id)
        self._arriving.pop(request_id, None)
        if self.ranks is not None:
            try:
                self.ranks.call(["forget", [request_id]])
            except Exception as err:  # the rank is gone or stuck: so is the worker
                log.warning("a rank did not forget %s: %s", request_id, err)

    def _on_receive(self, event: ReceiveEvent) -> None:  # receiver thread
        self.thread.submit(self._apply_receive, event)

    def _on_rank_event(self, rank: int, body: list) -> None:  # a rank group reader thread
        match body:
            case ["arrived", request_id, nbytes, seconds, routes]:
                event = Arrived(request_id, -1, None, None, nbytes, seconds, routes)
                self.thread.submit(self._apply_receive, event, rank)
            case ["failed", request_id, reason, corrupt]:
                event = TransferFailed(request_id, f"rank {rank}: {reason}", corrupt)
                self.thread.submit(self._apply_receive, event, rank)
            case ["broken", base]:  # the pair's next reservation opens new channels
                self.receiver.retire(base, f"a KV channel of rank {rank} broke")

    def _apply_receive(self, event: ReceiveEvent, rank: int = 0) -> None:
        if event.request_id not in self._leases:
            return  # aborted or expired meanwhile; its blocks are already free
        if isinstance(event, TransferFailed):
            del self._leases[event.request_id]
            self._fail(event.request_id, event.reason, corrupt=event.corrupt)
            return
        arrived = self._arriving.setdefault(event.request_id, {})
        arrived[rank] = event
        if len(arrived) < self.num_ranks:
            return  # other ranks' heads are still coming
        del self._arriving[event.request_id], self._leases[event.request_id]
        for source, each in arrived.items():
            self._follower_bytes += each.bytes_received if source else 0
            for route, nbytes in (each.route_bytes or {}).items():
                self.route_bytes[route] = self.route_bytes.get(route, 0) + nbytes
        self.transfers.seconds.observe(max(each.seconds for each in arrived.values()))
        first = arrived[0]  # its legs include route 0>0, with the token
        try:
            update = self.engine.admit(event.request_id, first.token_id, _logprobs(first))
        except Exception as err:  # noqa: BLE001  (its lease is gone: fail it here, or it waits)
            log.exception("admitting %s failed", event.request_id)
            self._forget(event.request_id)
            self.engine.abort(event.request_id)  # reserved or half-admitted: its blocks freed
            self.transfers.failures += 1
            self._publish([RequestFailed(event.request_id, f"admitting its KV failed: {err!r}")])
            return
        self._publish([update])

    def _step(self) -> None:
        self._publish(self.engine.step(self._on_layer))

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, (deadline, _) in self._leases.items() if deadline < now]:
            _, lease_s = self._leases.pop(request_id)
            self._fail(request_id, f"KV did not arrive within {lease_s:.1f}s")

    def _fail(self, request_id: str, reason: str, corrupt: bool = False) -> None:
        self._forget(request_id)  # the other ranks may still be receiving
        self.engine.release(request_id)
        self.transfers.failures += 1
        self.transfers.checksum_failures += corrupt
        self._publish([RequestFailed(request_id, reason, corrupt=corrupt)])

    def _publish(self, updates: list[WorkerUpdate]) -> None:
        if not updates:
            return
        with self._updates_ready:
            self._updates.extend(updates)
            self._updates_ready.notify_all()

    def _crashed(self, err: BaseException) -> None:
        with self._updates_ready:
            self._updates_ready.notify_all()

    def _stats(self) -> WorkerStats:
        snapshot = self.engine.snapshot()
        self.transfers.bytes = self.receiver.bytes_received + self._follower_bytes
        self.transfers.stale_frames = self.receiver.stale_frames
        return WorkerStats.of(
            self.worker_id,
            "decode",
            snapshot._replace(num_running=snapshot.num_running + len(self._leases)),
            **self.transfers.fields(),
            **self.thread.steps.fields(),
            requests_prefilled_locally=self.prefilled_locally,
            kv_channels_open=self.receiver.open_channels,
        )


def _logprobs(event: Arrived) -> TokenLogprobs | None:
    if event.logprob is None:
        return None
    return TokenLogprobs(event.logprob, [tuple(pair) for pair in event.top_logprobs or []])
