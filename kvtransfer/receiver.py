"""KVReceiver: the decode side of KV transfer. One thread per prefill peer receives its frames
and scatters each layer into the blocks reserved for the request.

    prefill P --channel(key)--> receiver thread for key
        StepFrame + a payload per layer      -> unpack each chunk's tokens (back to back in
                                                it) into the chunk's reserved slots
        DoneFrame(r, token, digest)          -> Arrived(r, token, ...)   (all layers are in and
                                                their checksums fold to `digest`)
        AbortFrame(r) / channel error        -> TransferFailed(r, reason)
        CloseFrame (the prefill side closes) -> the thread ends; anything still expected on the
                                                channel fails as on an error, with no warning
        a digest that differs                -> TransferFailed(r, reason, corrupt=True)

Fencing: frames and payloads are matched to reservations by the attempt's own request id, under
the lock `forget` takes, so nothing of an attempt that was forgotten (aborted, expired, retried)
lands in blocks that may now hold another request; such bytes are read, dropped and counted
(`stale_frames`).

Under tensor parallelism a request's KV arrives on several legs, one channel per route into
this rank (protocol/kv.py), each carrying some of the heads this rank holds: every leg sends
its own step frames, payloads and done frame (with the digest of its own payloads), and the
request has arrived once every leg's done frame has. A leg whose channel breaks retires the
pair's key, so the next reservation opens new channels.

Events go to `on_event`, called on the receiver thread; the decode worker hands them to its
engine thread. On CUDA each receiver thread works on a stream of its own (kvtransfer/streams.py)
and waits for each unpack before it lets go of the lock, so an Arrived request's KV is in place
for the engine's stream. Reservations (`expect`) and `forget` may be called from any thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels import ops
from kernels.threads import use_threads
from kvtransfer.integrity import DIGEST_START, fold, part_sums
from kvtransfer.recent import RecentKeys
from kvtransfer.streams import settle, use_own_stream
from kvtransfer.transport import Channel, Pending, Rendezvous, TransferError, Transport
from kvtransfer.wire import AbortFrame, CloseFrame, DoneFrame, PostedFrame, StepFrame
from protocol.kv import Route, base_key

log = logging.getLogger(__name__)
# How long a new channel waits for its prefill peer to connect. Longer than a transfer's
# deadline: dialling may be slow (a store that answers late), and a channel given up fails every
# request on it. Requests waiting on it still expire on their leases.
ACCEPT_WAIT_S = 60.0


class Arrived(NamedTuple):
    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    bytes_received: int
    seconds: float  # first frame to done frame
    route_bytes: dict[str, int] | None = None  # "src>dst" -> bytes, per route into this rank


class TransferFailed(NamedTuple):
    request_id: str
    reason: str
    corrupt: bool = False  # the bytes arrived but are not the ones sent


ReceiveEvent = Arrived | TransferFailed


class Leg(NamedTuple):
    """One route into this rank: its channel, and which of this rank's cache heads it fills."""

    key: str
    heads: range  # of this rank's cache
    route: Route


@dataclass
class _LegState:
    bytes_received: int = 0
    digest: int = DIGEST_START
    done: DoneFrame | None = None


@dataclass
class _Expected:
    base: str  # the pair's channel key; every leg's key derives from it
    slots: torch.Tensor  # [num_tokens - num_cached] cache slots, in token order
    num_cached: int
    legs: dict[str, tuple[Leg, _LegState]]
    bytes_expected: int
    verify: bool = True
    bytes_received: int = 0
    first_frame: float | None = None


class _Closed(Exception):
    """The prefill side closed the channel on purpose."""


class _StepBroke(Exception):
    """A step's receive failed; `posted` holds what may still be posted (pending, buffer)."""

    def __init__(
        self, error: Exception, posted: list[PostedFrame | tuple[Pending, torch.Tensor | None]]
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.posted = posted


class StagingBuffers:
    """Payload buffers kept for reuse by one receiver thread, so a step's receives land in
    memory that is already mapped (fresh host memory faults on first touch, page by page)."""

    def __init__(self, max_bytes: int = 1 << 28) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.max_bytes = max_bytes
        self.held_bytes = 0

    def take(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        spares = self.free.get(tuple(shape))
        if spares:
            buffer = spares.pop()
            self.held_bytes -= buffer.numel() * buffer.element_size()
            return buffer
        return like.new_empty(shape)

    def give_back(self, buffer: torch.Tensor) -> None:
        size = buffer.numel() * buffer.element_size()
        if self.held_bytes + size <= self.max_bytes:
            self.free.setdefault(tuple(buffer.shape), []).append(buffer)
            self.held_bytes += size


class KVReceiver:
    def __init__(
        self,
        transport: Transport,
        rendezvous: Rendezvous,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        decode_id: str,
        on_event: Callable[[ReceiveEvent], None],
        timeout: float,
        on_broken: Callable[[str], None] | None = None,
    ) -> None:
        """`on_broken(base)`: a channel of the pair `base` broke (called on its thread)."""
        self.transport = transport
        self.rendezvous = rendezvous
        self.kv_caches = kv_caches
        self.decode_id = decode_id
        self.on_event = on_event
        self.on_broken = on_broken
        self.timeout = timeout  # channel opening and each payload receive
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self._keys: dict[str, str] = {}  # prefill worker id -> its live channel key
        self._serving: set[str] = set()  # channel keys with a receiver thread
        # Pair keys given up, the most recent: a reservation made under one just before it was
        # (channel_key and expect are two calls) fails at once rather than start a receiver
        # that would wait out its accept for a peer that never dials it.
        self._retired = RecentKeys()
        self._generation = itertools.count()
        self.bytes_received = 0
        self.stale_frames = 0  # payloads and frames of attempts no longer expected, dropped
        # Receives still posted on channels that broke: a transport may write into their
        # buffers after the receiver gave up (UCX does), so the buffers must outlive the
        # channel, or the bytes land in memory Python has handed to something else. Each is
        # let go once its transport is done with it (`Pending.finished`).
        self._posted_on_broken: list[PostedFrame | tuple[Pending, torch.Tensor | None]] = []

    @property
    def open_channels(self) -> int:
        """Channels with a receiver thread."""
        with self._lock:
            return len(self._serving)

    def channel_key(self, prefill_id: str, broken: str | None = None) -> str:
        """The live channel key of a prefill peer (its routes' keys derive from it), new if
        it has none. `broken`: a key the prefill side found broken; if it still belongs to
        the live one here (this side has not noticed yet), that is given up for a new one."""
        if broken is not None and self._keys.get(prefill_id) == base_key(broken):
            self.retire(base_key(broken), f"KV channel {broken} broke")
        with self._lock:
            key = self._keys.get(prefill_id)
            if key is None:
                # The rendezvous port names this receiver: a worker that left the decode role
                # and came back has a new one, so a prefill worker never reuses an old channel.
                port = self.rendezvous.endpoint.port
                key = f"{prefill_id}->{self.decode_id}:{port}#{next(self._generation)}"
                self._keys[prefill_id] = key
            return key

    def expect(
        self,
        request_id: str,
        key: str,
        slots: list[int],
        num_cached: int,
        verify: bool = True,
        legs: list[Leg] | None = None,
    ) -> None:
        """Reserves `slots` for a request's KV, arriving on `legs` (default: all heads on
        channel `key`), whose keys derive from the pair's `key`; starts their receivers."""
        key_cache = self.kv_caches[0][0]
        if legs is None:
            num_heads = key_cache.shape[2]
            legs = [Leg(key, range(num_heads), Route(0, 0, 0, num_heads))]
        heads = sum(len(leg.heads) for leg in legs)
        expected = _Expected(
            base=key,
            slots=torch.tensor(slots, dtype=torch.int64, device=key_cache.device),
            num_cached=num_cached,
            legs={leg.key: (leg, _LegState()) for leg in legs},
            bytes_expected=len(self.kv_caches)
            * len(slots)
            * 2
            * heads
            * key_cache.shape[3]
            * key_cache.element_size(),
            verify=verify,
        )
        with self._lock:
            self._release_finished()
            retired = key in self._retired
            if not retired:
                self._expected[request_id] = expected
            starting = [] if retired else [leg for leg in legs if leg.key not in self._serving]
            self._serving.update(leg.key for leg in starting)
        if retired:
            self.on_event(TransferFailed(request_id, f"KV channel {key} was given up"))
        for leg in starting:
            threading.Thread(
                target=self._serve, args=(leg,), name=f"kv-recv-{leg.key}", daemon=True
            ).start()

    def forget(self, request_id: str) -> None:
        """Stops expecting a request; frames that still come for it are read and dropped."""
        with self._lock:
            self._expected.pop(request_id, None)

    def forget_all(self) -> None:
        with self._lock:
            self._expected.clear()

    def retire(self, base: str, reason: str) -> None:
        """Gives up the pair's channel key `base`: its requests fail, and the prefill peer
        gets a new key at its next reservation."""
        with self._lock:
            self._retired.add(base)
            for prefill_id in [p for p, key in self._keys.items() if key == base]:
                del self._keys[prefill_id]
            failed = [r for r, e in self._expected.items() if e.base == base]
            for request_id in failed:
                del self._expected[request_id]
        for request_id in failed:
            self.on_event(TransferFailed(request_id, reason))

    def _serve(self, leg: Leg) -> None:
        key = leg.key
        # Unpacking is a small memory-bound copy: one thread, or it fights the engine thread
        # for cores (a fresh thread would otherwise use them all).
        use_threads(1)
        # On CUDA its copies, checksums and unpacks wait for nothing the engine has queued.
        use_own_stream(self.kv_caches[0][0].device)
        channel, posted = None, None
        why = f"KV channel {key} broke"
        try:
            wait = max(self.timeout, ACCEPT_WAIT_S)
            channel = self.transport.accept(self.rendezvous.client(), key, wait)
            posted = PostedFrame(channel)
            spare = StagingBuffers()
            while True:
                posted = self._receive_one(channel, leg, posted, spare)
        except _Closed as closed:
            log.info("KV channel %s closed by its prefill side: %s", key, closed)
            posted = None  # nothing is posted on it: the close frame was the last message
            why = f"KV channel {key} closed: {closed}"
        except _StepBroke as broke:
            log.warning("KV channel %s closed: %s", key, broke.error)
            self._keep_posted(broke.posted)
        except TransferError as err:
            log.warning("KV channel %s closed: %s", key, err)
        except Exception:  # never let a receiver die silently: its requests must fail
            log.exception("KV receiver for %s failed", key)
        self._keep_posted([posted])
        if channel is not None:
            channel.close()
        with self._lock:  # (both at once: an expect between them would start a receiver anew)
            self._serving.discard(key)
            self._retired.add(base_key(key))
        self.retire(base_key(key), why)
        if self.on_broken is not None:
            self.on_broken(base_key(key))

    @property
    def held_after_break(self) -> int:
        """Receives of broken channels whose buffers are still held (their transport has not
        finished them yet)."""
        with self._lock:
            self._release_finished()
            return len(self._posted_on_broken)

    def _keep_posted(
        self, posted: list[PostedFrame | tuple[Pending, torch.Tensor | None] | None]
    ) -> None:
        with self._lock:
            self._release_finished()
            self._posted_on_broken.extend(p for p in posted if p is not None)

    def _release_finished(self) -> None:
        """Drops the held receives the transport has finished (under the lock)."""
        if self._posted_on_broken:
            self._posted_on_broken = [
                p for p in self._posted_on_broken if not _pending_of(p).finished
            ]

    def _receive_one(
        self, channel: Channel, leg: Leg, posted: PostedFrame, spare: StagingBuffers
    ) -> PostedFrame:
        """Handles one frame; returns the receive already posted for the next one."""
        frame = posted.read(timeout=None)
        if isinstance(frame, StepFrame):
            return self._receive_step(channel, leg, frame, spare)
        if isinstance(frame, CloseFrame):
            raise _Closed(frame.reason)
        with self._lock:
            expected = self._expected.get(frame.request_id)
            entry = expected.legs.get(leg.key) if expected is not None else None
            if entry is None:
                self.stale_frames += 1
                return PostedFrame(channel)
            finished = isinstance(frame, AbortFrame)
            if not finished:
                entry[1].done = frame
                finished = all(state.done is not None for _, state in expected.legs.values())
            if finished:
                del self._expected[frame.request_id]
        if finished:
            self._finish(frame, expected)
        return PostedFrame(channel)

    def _receive_step(
        self, channel: Channel, leg: Leg, frame: StepFrame, spare: StagingBuffers
    ) -> PostedFrame:
        """Posts every layer's payload receive of the step, then the next frame's; unpacks each
        layer as it lands (the prefill side sends them as its layers finish)."""
        tokens = sum(num_tokens for _, _, num_tokens in frame.chunks)
        lend = getattr(channel, "recv_lent_async", None)  # read in place where it can
        arriving = []
        for layer in range(frame.num_layers):
            kv = self.kv_caches[layer][0]
            shape = (2, tokens, len(leg.heads), kv.shape[3])
            lent = lend(shape, kv.dtype) if lend is not None else None
            if lent is not None:
                arriving.append((lent, None, layer))
                continue
            payload = spare.take(kv, shape)
            arriving.append((channel.recv_async(payload), payload, layer))
        following = PostedFrame(channel)
        done = 0
        try:
            for pending, payload, layer in arriving:
                pending.wait(self.timeout)
                if payload is None:  # lent: unpacked from the channel's memory, then let go
                    self._unpack(frame, leg, layer, pending.tensor)
                    pending.release()
                else:
                    self._unpack(frame, leg, layer, payload)
                    spare.give_back(payload)
                done += 1
        except Exception as err:
            # This and every later receive of the step may still be posted.
            still_posted = [entry[:2] for entry in arriving[done:]]
            raise _StepBroke(err, [*still_posted, following]) from err
        return following

    def _unpack(self, frame: StepFrame, leg: Leg, layer: int, payload: torch.Tensor) -> None:
        """Scatters each chunk's part of one layer's payload into its reserved slots."""
        with self._lock:
            live = [self._expected.get(request_id) for request_id, _, _ in frame.chunks]
            live = [e if e is not None and leg.key in e.legs else None for e in live]
        # The checksums outside the lock (the engine thread takes it to reserve and forget).
        verified = any(e is not None and e.verify for e in live)
        sizes = [num_tokens for _, _, num_tokens in frame.chunks]
        sums = part_sums(payload, sizes) if verified else None
        key_cache, value_cache = self.kv_caches[layer]
        token_bytes = payload[:, :1].numel() * payload.element_size()
        first = 0
        # Under the lock: once forget() returns, no write lands in blocks that may be reused.
        with self._lock:
            for index, (request_id, start, num_tokens) in enumerate(frame.chunks):
                part = slice(first, first + num_tokens)
                first += num_tokens
                expected = live[index]
                if expected is None or self._expected.get(request_id) is not expected:
                    self.stale_frames += 1  # expired, aborted or retried: drop its bytes
                    continue
                state = expected.legs[leg.key][1]
                if sums is not None and expected.verify:
                    state.digest = fold(state.digest, sums[index])
                offset = start - expected.num_cached
                slots = expected.slots[offset : offset + num_tokens]
                ops.unpack_kv(payload[:, part], key_cache, value_cache, slots, leg.heads)
                nbytes = num_tokens * token_bytes
                state.bytes_received += nbytes
                expected.bytes_received += nbytes
                self.bytes_received += nbytes
                expected.first_frame = expected.first_frame or time.monotonic()
            settle(key_cache.device)  # written before forget() can hand the blocks on

    def _finish(self, frame: DoneFrame | AbortFrame, expected: _Expected) -> None:
        """`frame`: an abort, or the last leg's done frame."""
        if isinstance(frame, AbortFrame):
            self.on_event(TransferFailed(frame.request_id, f"prefill aborted: {frame.reason}"))
            return
        if expected.bytes_received != expected.bytes_expected:
            reason = f"received {expected.bytes_received} of {expected.bytes_expected} KV bytes"
            self.on_event(TransferFailed(frame.request_id, reason))
            return
        states = [state for _, state in expected.legs.values()]
        if expected.verify and any(state.done.digest != state.digest for state in states):
            reason = "KV checksum mismatch: the bytes received are not the bytes sent"
            self.on_event(TransferFailed(frame.request_id, reason, corrupt=True))
            return
        # Route 0>0 carries the sampled token; a follower rank's legs carry none.
        token = next(
            (state.done for leg, state in expected.legs.values() if leg.route[:2] == (0, 0)),
            frame,
        )
        seconds = time.monotonic() - (expected.first_frame or time.monotonic())
        routes = {
            f"{leg.route.src}>{leg.route.dst}": state.bytes_received
            for leg, state in expected.legs.values()
        }
        self.on_event(
            Arrived(
                frame.request_id,
                token.token_id,
                token.logprob,
                token.top_logprobs,
                expected.bytes_received,
                seconds,
                routes,
            )
        )


def _pending_of(posted: PostedFrame | tuple[Pending, torch.Tensor | None]) -> Pending:
    return posted.pending if isinstance(posted, PostedFrame) else posted[0]
