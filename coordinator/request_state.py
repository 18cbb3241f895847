"""TrackedRequest: one client request as the coordinator follows it across workers and retries.

Output tokens are kept by index: a worker reports `first_index` with every batch, so a token
seen twice (the prefill worker's first token, then the decode worker's copy; or a retry) is
dropped, and tokens are never skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from coordinator.router import Route
from engine.output_processor import RequestState
from engine.outputs import RequestOutput, StreamFailed
from engine.tokenizer import Tokenizer
from protocol.messages import TokenUpdate, WorkRequest
from protocol.sampling import FinishReason, PromptLogprob, SamplingParams, TokenLogprobs


class TrackedRequest:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        stream_interval: int = 1,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrived_at = time.monotonic()
        self.frontend = RequestState(request_id, prompt_ids, params, tokenizer)
        self.output_ids: list[int] = []
        self.stream: asyncio.Queue[RequestOutput | StreamFailed] = asyncio.Queue()
        self.attempt = 0
        self.route: Route | None = None
        # this attempt's prompt tokens still counted in its prefill worker's queue (router)
        self.prefill_queued = False
        self.ended = asyncio.Event()  # finished, or lost by its current worker
        self.lost_reason: str | None = None
        self.failed = False  # ended in an error the client has been given
        self.avoid: set[str] = set()  # workers that failed it: chosen again only as a last resort
        self.corrupt_transfers = 0  # attempts whose KV failed its checksum
        self.first_token_at: float | None = None  # monotonic: this attempt's first token left
        # (decode worker, channel key) its prefill found broken: the next reservation replaces it
        self.broken_channel: tuple[str, str] | None = None
        self.num_cached_tokens = 0
        self.queue_seconds: float | None = None
        self.prompt_logprobs: list[PromptLogprob | None] | None = None
        # While its prefill worker scores its prompt (SamplingParams.prompt_logprobs), the decode
        # worker's updates wait here: the first output must carry the prompt's logprobs.
        self.awaits_prompt = False
        self._early: list[TokenUpdate] = []
        # Tokens reach the stream `stream_interval` at a time (the first and the last at once);
        # these arrived since the last output.
        self.stream_interval = stream_interval
        self._held_ids: list[int] = []
        self._held_logprobs: list[TokenLogprobs | None] = []
        # A stop string in held tokens, found as the request failed: nothing told its workers,
        # so ending its attempt must (a finish otherwise means they dropped it already).
        self.abort_owed = False

    @property
    def worker_request_id(self) -> str:
        """Distinct per attempt, so a late message about an old attempt is recognised."""
        return f"{self.request_id}#{self.attempt}"

    @property
    def finished(self) -> bool:
        return self.frontend.finished

    def next_attempt(self) -> WorkRequest:
        self.attempt += 1
        self.prefill_queued = False
        self.ended = asyncio.Event()
        self.lost_reason = None
        self.first_token_at = None
        self.awaits_prompt, self._early = False, []
        return WorkRequest(
            self.worker_request_id, self.prompt_ids, self.params, list(self.output_ids)
        )

    def aged(self, work: WorkRequest) -> WorkRequest:
        """`work` as it leaves for a worker: with how long ago the request arrived."""
        return work._replace(age_s=time.monotonic() - self.arrived_at)

    def lose(self, reason: str) -> None:
        if not self.finished:
            self.lost_reason = reason
            self.ended.set()

    def forget_loss(self) -> None:
        """The attempt holds no worker again (it is being placed anew): a loss that a worker
        leaving mid-reservation caused is void, or its next placement would end at once."""
        if not self.failed and not self.finished:
            self.lost_reason = None
            self.ended.clear()

    def accept(self, update: TokenUpdate) -> bool:
        """Folds a worker's update in; True if a stop string ended the request (the caller
        then aborts it on its worker)."""
        if self.awaits_prompt and self.prompt_logprobs is None:
            self._early.append(update)
            return False
        skip = len(self.output_ids) - update.first_index
        if skip < 0:  # a gap: cannot happen with in-order workers; treat as a lost worker
            self.lose(f"token {len(self.output_ids)} never arrived")
            return False
        new_ids, new_logprobs = update.token_ids[skip:], update.logprobs[skip:]
        if not new_ids and update.finish_reason is None:
            return False
        if update.queue_seconds is not None and self.queue_seconds is None:
            self.queue_seconds = update.queue_seconds
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        self.prompt_logprobs = self.prompt_logprobs or update.prompt_logprobs
        return self._emit(new_ids, new_logprobs, update.finish_reason, update.stop_token_id)

    def accept_first(self, index: int, token_id: int, logprobs: TokenLogprobs | None) -> bool:
        """The prefill worker's token: streamed at once, before the decode worker reports it.
        True if a stop string ended the request (the caller then aborts it on its worker)."""
        if index == len(self.output_ids) and not self.finished:
            return self._emit([token_id], [logprobs], None, None)
        return False

    def accept_prompt(self, prompt_logprobs: list[PromptLogprob | None] | None) -> bool:
        """The prefill worker's scores of the prompt (None: none asked for); the decode
        worker's updates held for them follow. True as `accept` says."""
        self.prompt_logprobs = self.prompt_logprobs or prompt_logprobs
        self.awaits_prompt, early, self._early = False, self._early, []
        hit = False
        for update in early:
            hit = self.accept(update) or hit
        return hit

    def _emit(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
        finish_reason: FinishReason | None,
        stop_token_id: int | None,
        flush: bool = False,
    ) -> bool:
        """Hands these tokens, with any held before, to the stream as one output, unless the
        stream interval holds them (`flush`: never)."""
        self.output_ids.extend(token_ids)
        if not flush and self._holds(len(token_ids), finish_reason):
            self._held_ids += token_ids
            self._held_logprobs += logprobs
            return False
        if self._held_ids:
            token_ids, logprobs = self._held_ids + token_ids, self._held_logprobs + logprobs
            self._held_ids, self._held_logprobs = [], []
        update = TokenUpdate(
            request_id=self.request_id,
            first_index=len(self.output_ids) - len(token_ids),
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_token_id=stop_token_id,
            num_prompt_tokens=len(self.prompt_ids),
            num_cached_tokens=self.num_cached_tokens,
            queue_seconds=self.queue_seconds,
            prompt_logprobs=self.prompt_logprobs,
        )
        output, stop_string_hit = self.frontend.apply(update)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.stream.put_nowait(output)
        if self.finished:
            self.ended.set()
        return stop_string_hit

    def _holds(self, num_new: int, finish_reason: FinishReason | None) -> bool:
        """Whether new tokens wait for more: not the first ones, nor the last, nor a full
        interval's worth."""
        return (
            finish_reason is None
            and bool(self.frontend.token_ids)
            and len(self._held_ids) + num_new < self.stream_interval
        )

    def finish_at_length(self, max_model_len: int) -> bool:
        """Ends the request with finish reason "length" if its output already holds all it may
        (max_tokens, or the model's context): a lost attempt whose prefill token was the last
        allowed is not retried for one more. True if it ended so."""
        room = min(self.params.max_tokens, max_model_len - len(self.prompt_ids))
        if self.finished or self.failed or len(self.output_ids) < room:
            return False
        self._emit([], [], FinishReason.LENGTH, None, flush=True)
        return True

    def fail(self, err: Exception) -> None:
        if self._held_ids and not self.finished:  # what was generated reaches the client first
            # (unless its output is what broke: then only the error does)
            with contextlib.suppress(Exception):
                self.abort_owed = self._emit([], [], None, None, flush=True)
        self.failed = True
        self.stream.put_nowait(StreamFailed(err))
        self.ended.set()
