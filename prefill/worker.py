"""PrefillWorker: computes prompts and streams their KV, layer by layer, to decode workers.

    submit(request, ticket) -> engine thread: chunked prefill under a token budget
        after layer l of a step: pack each request's new K/V of layer l -> KVSender (own thread)
        after the last chunk: sample the next token -> done frame -> PrefillResult to the caller
    The request's blocks are freed as soon as its step ends (the packed buffers own the bytes);
    its full blocks stay in this worker's prefix cache.

A plain class (no Ray); `prefill.actor` wraps it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import torch

from coordinator.stats import WorkerStats, bucket_counts
from engine.block_manager import slots_of
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.engine_thread import EngineThread
from engine.requests import WorkRequest
from engine.sampler import TokenLogprobs
from engine.scheduler import StepPlan
from kernels import ops
from kvtransfer.sender import KVSender, SendRecord
from kvtransfer.ticket import KVLayout, Ticket
from kvtransfer.transport import TransferError, Transport


class PrefillResult(NamedTuple):
    request_id: str
    token_id: int  # the token sampled after the prompt (output index len(output_ids))
    logprobs: TokenLogprobs | None
    num_cached_tokens: int  # prompt tokens this worker found in its own prefix cache
    bytes_sent: int
    transfer_seconds: float  # first layer sent to done frame sent
    exposed_seconds: float  # of that, what came after the prefill step ended (TTFT pays it)
    layers_computed: list[tuple[int, float]]  # (layer, monotonic time its KV was packed)
    layers_sent: list[tuple[int, float, float]]  # (layer, send start, send end)


ResultCallback = Callable[[str, PrefillResult | Exception], None]


def kv_layout(engine: LLMEngine) -> KVLayout:
    cfg = engine.model_config
    return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, engine.config.dtype)


class _Pending:
    def __init__(self, request: WorkRequest, ticket: Ticket) -> None:
        self.request = request
        self.ticket = ticket
        self.layers_computed: list[tuple[int, float]] = []
        self.sent_upto = ticket.num_cached_tokens  # tokens before this are sent or not needed
        # token, its logprobs, prompt tokens cached here, monotonic time its step ended
        self.sampled: tuple[int, TokenLogprobs | None, int, float] | None = None


class PrefillWorker:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        transport: Transport,
        transfer_timeout: float,
        pipeline_layers: bool = True,
    ) -> None:
        """`pipeline_layers=False` holds every layer back until the step's forward pass ends
        (send after prefill): the baseline that benchmarks/kv_transfer.py compares against."""
        self.worker_id = worker_id
        self.transport_name = transport.name
        self.pipeline_layers = pipeline_layers
        self._held: list[tuple] = []
        self.engine = LLMEngine(config)
        self.layout = kv_layout(self.engine)
        self.sender = KVSender(transport, transfer_timeout, self._on_sent)
        self._pending: dict[str, _Pending] = {}
        self._callbacks: dict[str, ResultCallback] = {}
        self._step_slots: dict[str, tuple[int, torch.Tensor]] = {}
        self.bytes_sent = 0
        self.transfer_failures = 0
        self.transfer_seconds: list[float] = []
        self.thread = EngineThread(
            f"prefill-{worker_id}", self._step, lambda: self.engine.has_unfinished, self._crashed
        )

    # -- any thread ------------------------------------------------------------------------

    def submit(self, request: WorkRequest, ticket: Ticket, on_result: ResultCallback) -> None:
        """Queues a prefill; `on_result(request_id, result or error)` runs exactly once, on a
        worker thread."""
        if ticket.layout != self.layout:
            on_result(request.request_id, ValueError(f"KV layout {ticket.layout} != {self.layout}"))
            return
        self.thread.submit(self._add, request, ticket, on_result).add_done_callback(
            lambda f: f.exception() and on_result(request.request_id, f.exception())
        )

    def abort(self, request_id: str) -> None:
        self.thread.submit(self._abort, request_id)

    def stats(self) -> Future:
        return self.thread.submit(self._stats)

    # -- engine thread ---------------------------------------------------------------------

    def _add(self, request: WorkRequest, ticket: Ticket, on_result: ResultCallback) -> None:
        # Stop after one new token: its decode worker generates the rest.
        num_out = len(request.output_ids)
        params = dataclasses.replace(
            request.params,
            max_tokens=num_out + 1,
            min_tokens=min(request.params.min_tokens, num_out + 1),
        )
        self.engine.add_request(request.request_id, request.prompt_ids, params, request.output_ids)
        self._pending[request.request_id] = _Pending(request, ticket)
        self._callbacks[request.request_id] = on_result
        self.sender.open(ticket)

    def _abort(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        self.engine.abort(request_id)
        self.sender.send_abort(pending.ticket, "aborted by the coordinator")

    def _step(self) -> None:
        self._step_slots.clear()
        updates = self.engine.step(on_layer=self._send_layer)
        for held in self._held:
            self.sender.send_layer(*held)
        self._held.clear()
        for update in updates:
            pending = self._pending.get(update.request_id)
            if pending is None:
                continue
            token, logprobs = update.new_token_ids[0], update.new_logprobs[0]
            pending.sampled = (token, logprobs, update.num_cached_tokens, time.monotonic())
            self.sender.send_done(pending.ticket, token, logprobs)

    def _send_layer(self, plan: StepPlan, layer: int) -> None:
        if layer == 0:
            self._announce_step(plan)
        key_cache, value_cache = self.engine.runner.kv_caches[layer]
        now = time.monotonic()
        for request_id, (_, slots) in self._step_slots.items():  # the announced order
            pending = self._pending[request_id]
            payload = ops.pack_kv(key_cache, value_cache, slots)  # [2, n, kv_heads, head_dim]
            job = (pending.ticket, layer, payload, _record_event(payload))
            if self.pipeline_layers:
                self.sender.send_layer(*job)
            else:
                self._held.append(job)
            pending.layers_computed.append((layer, now))

    def _announce_step(self, plan: StepPlan) -> None:
        """Picks the tokens each request sends this step (its chunk, plus earlier tokens found
        in this worker's prefix cache that its decode worker lacks) and announces them, one
        StepFrame per decode worker, in the order their layers will follow."""
        bs, device = self.engine.config.block_size, self.engine.runner.device
        by_channel: dict[str, list[tuple[Ticket, int, int]]] = {}
        for chunk in plan.chunks:
            pending = self._pending.get(chunk.seq.request_id)
            if pending is None or pending.sent_upto >= chunk.end:
                continue
            start, ticket = pending.sent_upto, pending.ticket
            slots = slots_of(chunk.seq.block_table, start, chunk.end, bs)
            by_channel.setdefault(ticket.channel_key, []).append((ticket, start, len(slots)))
            pending.sent_upto = chunk.end
            self._step_slots[ticket.request_id] = (
                start, torch.tensor(slots, dtype=torch.int64, device=device)
            )  # fmt: skip
        ordered = {}
        for chunks in by_channel.values():
            self.sender.send_step(chunks, self.layout.num_layers)
            for ticket, _, _ in chunks:
                ordered[ticket.request_id] = self._step_slots[ticket.request_id]
        self._step_slots = ordered

    def _stats(self) -> WorkerStats:
        scheduler, blocks = self.engine.scheduler, self.engine.blocks
        seconds = list(self.transfer_seconds)
        return WorkerStats(
            worker=self.worker_id,
            pool="prefill",
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            queued_prefill_tokens=sum(
                s.num_uncomputed_tokens for s in (*scheduler.running, *scheduler.waiting)
            ),
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=blocks.num_blocks,
            prefix_cache_queries=blocks.prefix_queries,
            prefix_cache_hits=blocks.prefix_hits,
            kv_transfer_bytes=self.bytes_sent,
            kv_transfer_failures=self.transfer_failures,
            kv_transfer_count=len(seconds),
            kv_transfer_seconds_sum=sum(seconds),
            kv_transfer_buckets=bucket_counts(seconds),
            kv_transport=self.transport_name,
        )

    def _crashed(self, err: BaseException) -> None:
        for request_id in list(self._callbacks):
            self._resolve(request_id, RuntimeError(f"prefill worker crashed: {err}"))

    # -- sender thread ---------------------------------------------------------------------

    def _on_sent(self, request_id: str, record: SendRecord, error: TransferError | None) -> None:
        pending = self._pending.get(request_id)
        if error is not None:
            self.transfer_failures += 1
            self.abort(request_id)
            self._resolve(request_id, error)
            return
        self.bytes_sent += record.bytes_sent
        self.transfer_seconds.append(record.seconds)
        if pending is None or pending.sampled is None:
            return
        self._pending.pop(request_id, None)
        token, logprobs, num_cached, step_end = pending.sampled
        result = PrefillResult(
            request_id,
            token,
            logprobs,
            num_cached,
            record.bytes_sent,
            record.seconds,
            max(0.0, record.finished - step_end),
            pending.layers_computed,
            record.layer_sends,
        )
        self._resolve(request_id, result)

    def _resolve(self, request_id: str, outcome: PrefillResult | Exception) -> None:
        callback = self._callbacks.pop(request_id, None)
        if callback is not None:
            callback(request_id, outcome)

    def shutdown(self) -> None:
        self.thread.stop()
        self.sender.close()


def _record_event(payload: torch.Tensor):
    if payload.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
