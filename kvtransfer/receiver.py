"""KVReceiver: the decode side of KV transfer. One thread per prefill peer receives its frames
and scatters each layer into the blocks reserved for the request.

    prefill P --channel(key)--> receiver thread for key
        StepFrame + a payload per (layer, chunk) -> unpack into the chunk's reserved slots
        DoneFrame(r, token, digest)          -> Arrived(r, token, ...)   (all layers are in and
                                                their checksums fold to `digest`)
        AbortFrame(r) / channel error        -> TransferFailed(r, reason)
        a digest that differs                -> TransferFailed(r, reason, corrupt=True)

Fencing: frames and payloads are matched to reservations by the attempt's own request id, under
the lock `forget` takes, so nothing of an attempt that was forgotten (aborted, expired, retried)
lands in blocks that may now hold another request; such bytes are read, dropped and counted
(`stale_frames`).

Events go to `on_event`, called on the receiver thread; the decode worker hands them to its
engine thread. Reservations (`expect`) and `forget` may be called from any thread.
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
from kvtransfer.integrity import DIGEST_START, fold, payload_sum
from kvtransfer.transport import Channel, Rendezvous, TransferError, Transport
from kvtransfer.wire import AbortFrame, DoneFrame, PostedFrame, StepFrame
from protocol.kv import KVLayout

log = logging.getLogger(__name__)


class Arrived(NamedTuple):
    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    bytes_received: int
    seconds: float  # first frame to done frame


class TransferFailed(NamedTuple):
    request_id: str
    reason: str
    corrupt: bool = False  # the bytes arrived but are not the ones sent


ReceiveEvent = Arrived | TransferFailed


@dataclass
class _Expected:
    key: str
    slots: torch.Tensor  # [num_tokens - num_cached] cache slots, in token order
    num_cached: int
    bytes_expected: int
    verify: bool = True
    bytes_received: int = 0
    first_frame: float | None = None
    digest: int = DIGEST_START


class _StepBroke(Exception):
    """A step's receive failed; `posted` holds what may still be posted (pending, buffer)."""

    def __init__(self, error: Exception, posted: list[object]) -> None:
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
        layout: KVLayout,
        decode_id: str,
        on_event: Callable[[ReceiveEvent], None],
        timeout: float,
    ) -> None:
        self.transport = transport
        self.rendezvous = rendezvous
        self.kv_caches = kv_caches
        self.layout = layout
        self.decode_id = decode_id
        self.on_event = on_event
        self.timeout = timeout  # channel opening and each payload receive
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self._keys: dict[str, str] = {}  # prefill worker id -> its live channel key
        self._generation = itertools.count()
        self.bytes_received = 0
        self.stale_frames = 0  # payloads and frames of attempts no longer expected, dropped
        # Receives still posted on channels that broke: a transport may write into their
        # buffers after the receiver gave up (UCX does), so the buffers must outlive the
        # channel, or the bytes land in memory Python has handed to something else.
        self._posted_on_broken: list[object] = []

    def channel_key(self, prefill_id: str, broken: str | None = None) -> str:
        """The live channel key for a prefill peer, starting a receiver thread if none runs.
        `broken`: a key the prefill side found broken; if it is still the live one here (this
        side has not noticed yet), it is given up and a new channel starts."""
        if broken is not None and self._keys.get(prefill_id) == broken:
            self._close_key(prefill_id, broken)
        with self._lock:
            key = self._keys.get(prefill_id)
            if key is None:
                # The rendezvous port names this receiver: a worker that left the decode role
                # and came back has a new one, so a prefill worker never reuses an old channel.
                port = self.rendezvous.endpoint.port
                key = f"{prefill_id}->{self.decode_id}:{port}#{next(self._generation)}"
                self._keys[prefill_id] = key
                threading.Thread(
                    target=self._serve, args=(prefill_id, key), name=f"kv-recv-{key}", daemon=True
                ).start()
            return key

    def expect(
        self, request_id: str, key: str, slots: list[int], num_cached: int, verify: bool = True
    ) -> None:
        expected = _Expected(
            key=key,
            slots=torch.tensor(slots, dtype=torch.int64, device=self.kv_caches[0][0].device),
            num_cached=num_cached,
            bytes_expected=self.layout.num_layers
            * len(slots)
            * self.layout.bytes_per_token_layer(),
            verify=verify,
        )
        with self._lock:
            self._expected[request_id] = expected

    def forget(self, request_id: str) -> None:
        """Stops expecting a request; frames that still come for it are read and dropped."""
        with self._lock:
            self._expected.pop(request_id, None)

    def _serve(self, prefill_id: str, key: str) -> None:
        # Unpacking is a small memory-bound copy: one thread, or it fights the engine thread
        # for cores (a fresh thread would otherwise use them all).
        torch.set_num_threads(1)
        channel, posted = None, None
        try:
            channel = self.transport.accept(self.rendezvous.store, key, self.timeout)
            posted = PostedFrame(channel)
            spare = StagingBuffers()
            while True:
                posted = self._receive_one(channel, posted, spare)
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
        self._close_key(prefill_id, key)

    def _keep_posted(self, posted: list[object]) -> None:
        with self._lock:
            self._posted_on_broken.extend(p for p in posted if p is not None)

    def _receive_one(
        self, channel: Channel, posted: PostedFrame, spare: StagingBuffers
    ) -> PostedFrame:
        """Handles one frame; returns the receive already posted for the next one."""
        frame = posted.read(timeout=None)
        if isinstance(frame, StepFrame):
            return self._receive_step(channel, frame, spare)
        with self._lock:
            expected = self._expected.pop(frame.request_id, None)
            if expected is None:
                self.stale_frames += 1
        if expected is not None:
            self._finish(frame, expected)
        return PostedFrame(channel)

    def _receive_step(
        self, channel: Channel, frame: StepFrame, spare: StagingBuffers
    ) -> PostedFrame:
        """Posts every payload receive of the step, then the next frame's; unpacks each layer
        as it lands (the prefill side sends them as its layers finish)."""
        arriving = []
        for layer in range(frame.num_layers):
            kv = self.kv_caches[layer][0]
            for request_id, start, num_tokens in frame.chunks:
                payload = spare.take(kv, (2, num_tokens, *kv.shape[2:]))  # [2, n, heads, dim]
                arriving.append((channel.recv_async(payload), payload, layer, request_id, start))
        following = PostedFrame(channel)
        done = 0
        try:
            for pending, payload, layer, request_id, start in arriving:
                pending.wait(self.timeout)
                self._unpack(request_id, layer, start, payload)
                spare.give_back(payload)
                done += 1
        except Exception as err:
            # This and every later receive of the step may still be posted.
            still_posted = [entry[:2] for entry in arriving[done:]]
            raise _StepBroke(err, [*still_posted, following]) from err
        return following

    def _unpack(self, request_id: str, layer: int, start: int, payload: torch.Tensor) -> None:
        with self._lock:
            expected = self._expected.get(request_id)
        # The checksum outside the lock (the engine thread takes it to reserve and forget).
        checksum = payload_sum(payload) if expected is not None and expected.verify else None
        # Under the lock: once forget() returns, no write lands in blocks that may be reused.
        with self._lock:
            if expected is None or self._expected.get(request_id) is not expected:
                self.stale_frames += 1  # expired, aborted or retried meanwhile: drop the bytes
                return
            if checksum is not None:
                expected.digest = fold(expected.digest, checksum)
            offset = start - expected.num_cached
            slots = expected.slots[offset : offset + payload.shape[1]]
            key_cache, value_cache = self.kv_caches[layer]
            ops.unpack_kv(payload, key_cache, value_cache, slots)
        expected.first_frame = expected.first_frame or time.monotonic()
        nbytes = payload.numel() * payload.element_size()
        expected.bytes_received += nbytes
        self.bytes_received += nbytes

    def _finish(self, frame: DoneFrame | AbortFrame, expected: _Expected) -> None:
        if isinstance(frame, AbortFrame):
            self.on_event(TransferFailed(frame.request_id, f"prefill aborted: {frame.reason}"))
        elif expected.bytes_received != expected.bytes_expected:
            reason = f"received {expected.bytes_received} of {expected.bytes_expected} KV bytes"
            self.on_event(TransferFailed(frame.request_id, reason))
        elif expected.verify and frame.digest != expected.digest:
            reason = "KV checksum mismatch: the bytes received are not the bytes sent"
            self.on_event(TransferFailed(frame.request_id, reason, corrupt=True))
        else:
            seconds = time.monotonic() - (expected.first_frame or time.monotonic())
            self.on_event(
                Arrived(
                    frame.request_id,
                    frame.token_id,
                    frame.logprob,
                    frame.top_logprobs,
                    expected.bytes_received,
                    seconds,
                )
            )

    def _close_key(self, prefill_id: str, key: str) -> None:
        with self._lock:
            if self._keys.get(prefill_id) == key:
                del self._keys[prefill_id]
            failed = [r for r, e in self._expected.items() if e.key == key]
            for request_id in failed:
                del self._expected[request_id]
        for request_id in failed:
            self.on_event(TransferFailed(request_id, f"KV channel {key} broke"))
