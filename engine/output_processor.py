"""Per-request output state in the frontend: text, stop strings, and what to stream next."""

from __future__ import annotations

from engine.outputs import RequestOutput, TextSoFar, TokensSoFar
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from protocol.messages import TokenUpdate
from protocol.sampling import FinishReason, PromptLogprob, SamplingParams


class RequestState:
    """Folds the engine's token updates for one request into RequestOutputs.

    While streaming, the last `len(longest stop string) - 1` characters are held back: they might
    turn out to be the start of a stop string, which must never reach the client.
    """

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[PromptLogprob | None] | None = None
        # The text is kept as the pieces the detokenizer gave (a string grown by += is copied
        # whole each time while an output holds it) and its length, which a stop string may
        # cut below the pieces' total. `recent` is its end from `recent_at` on: the part not
        # sent yet and the `holdback` characters a stop string may still begin in.
        self.text_pieces: list[str] = []
        self.text_length = 0
        self.recent = ""
        self.recent_at = 0
        self.num_sent_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, update: TokenUpdate) -> tuple[RequestOutput, bool]:
        """The request's output after `update`, and whether a stop string just ended it (the
        caller then aborts the request in the engine)."""
        tokens = update.token_ids
        if self.prompt_logprobs is None:
            self.prompt_logprobs = update.prompt_logprobs
        self.token_ids.extend(tokens)
        if self.logprobs is not None:
            self.logprobs.extend(update.logprobs)
        text_tokens = tokens
        if update.stop_token_id is not None and not self.params.include_stop_str_in_output:
            text_tokens = tokens[:-1]
        scan_from = max(0, self.text_length - self.holdback)
        self._add_text(self.detokenizer.push(text_tokens))
        if update.finish_reason is not None:
            self._add_text(self.detokenizer.flush())
            self.finish_reason = update.finish_reason.value
            # A stop token the request named; None for EOS, as vLLM reports it.
            token = update.stop_token_id
            self.stop_reason = token if token in self.params.stop_token_ids else None
        # As vLLM: stop strings count once min_tokens are out, as EOS and stop ids do (those
        # are masked until then)
        hit = len(self.token_ids) >= self.params.min_tokens and self._find_stop_string(scan_from)
        return self._output(update, len(tokens)), hit

    def _add_text(self, piece: str) -> None:
        if piece:
            self.text_pieces.append(piece)
            self.recent += piece
            self.text_length += len(piece)

    def _find_stop_string(self, scan_from: int) -> bool:
        """A stop string that ends in the new text; `scan_from` >= `recent_at` (a stop string
        that began earlier ended before the new text, and was found then)."""
        if not self.params.stop:
            return False
        found = [(self.recent.find(s, scan_from - self.recent_at), s) for s in self.params.stop]
        found = [(at, s) for at, s in found if at >= 0]
        if not found:
            return False
        at, stop = min(found)
        keep = at + len(stop) if self.params.include_stop_str_in_output else at
        self.recent = self.recent[:keep]
        self.text_length = self.recent_at + keep
        self.finish_reason, self.stop_reason = FinishReason.STOP.value, stop
        return True

    def _output(self, update: TokenUpdate, num_new: int) -> RequestOutput:
        length = self.text_length
        sendable = length if self.finished else max(0, length - self.holdback)
        sendable = max(sendable, self.num_sent_chars)
        delta = self.recent[self.num_sent_chars - self.recent_at : sendable - self.recent_at]
        self.num_sent_chars = sendable
        # what may still be sent, or be the start of a stop string, stays in `recent`
        drop = min(sendable, max(0, length - self.holdback)) - self.recent_at
        if drop > 0:
            self.recent = self.recent[drop:]
            self.recent_at += drop
        num_tokens = len(self.token_ids)
        # the last output's tokens a plain list (once per request), ready for JSON and the like
        tokens = list(self.token_ids) if self.finished else TokensSoFar(self.token_ids, num_tokens)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=tokens,
            text=TextSoFar(self.text_pieces, len(self.text_pieces), length),
            delta_token_ids=self.token_ids[num_tokens - num_new :],
            delta_text=delta,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=update.num_cached_tokens,
            queue_seconds=update.queue_seconds,
            prompt_logprobs=self.prompt_logprobs,
        )
