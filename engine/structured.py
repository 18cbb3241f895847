"""Structured output: a request's tokens held to a JSON schema, to any JSON value, or to a
regular expression (OpenAI's `response_format`), with xgrammar's grammar matchers.

Each structured sequence has a matcher that has read its output so far. Before each sample it
says which tokens may come next (a bitmask of the vocabulary: `allowed`); the sampler gives
the others no chance; the token sampled is read back in (`advance`). A matcher is made the
first time its sequence samples, reading every output token it already has: so a decode
worker that takes over a request (its first token from the prefill worker, or the tokens a
lost attempt streamed) needs nothing from the worker before it. The grammar completed, the
sequence ends (`finished`), even with `ignore_eos`.

Grammars compile on a thread of their own, never on the engine thread: a large schema takes
up to about a second (a pathological one, minutes), and every other request on the engine
would wait that long. A request is held out of the scheduler until its grammar is ready
(`prepare` at arrival, `ready` each step); one whose grammar is not ready `COMPILE_TIMEOUT_S`
after its compile began fails alone. xgrammar releases the GIL while it compiles.

xgrammar is optional (`pip install xgrammar`): without it a structured request fails with a
message that says so.
"""

from __future__ import annotations

import concurrent.futures
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from protocol.errors import RequestError

COMPILED_KEPT = 64  # compiled grammars kept per engine, the most recently used
# A grammar not compiled this long after its compile began fails the requests that wait for it.
# The format limits (protocol/sampling.py) keep real schemas near a second on a CPU core; the
# coordinator waits 30 s and more for a prefill.
COMPILE_TIMEOUT_S = 20.0


class Structures:
    """The grammars of one engine's structured requests, and each sequence's matcher."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # spec -> (its compile's future, when the compile was asked for: time.monotonic())
        self._compiling: dict[tuple[str, str], tuple[concurrent.futures.Future, float]] = {}
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future, tuple[str, str]]] | None = (
            None
        )
        self.matchers: dict[str, Any] = {}  # request id -> its matcher

    def prepare(self, spec: tuple[str, str]) -> None:
        """Starts compiling `spec` off the engine thread, unless it is compiled or compiling."""
        self._settle()
        if spec in self._compiled or spec in self._compiling:
            return
        if self._jobs is None:  # a daemon: a compile still running never holds up an exit
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._compile_jobs, name="grammar-compile", daemon=True).start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._compiling[spec] = (future, time.monotonic())
        self._jobs.put((future, spec))

    def _settle(self) -> None:
        """Compiles that ended leave `_compiling`, waited for or not (their requests may have
        been aborted): a grammar is kept; an error is forgotten once every request that waited
        for it has read it (they all have, past the compile's time)."""
        now = time.monotonic()
        for spec, (future, started) in list(self._compiling.items()):
            if not future.done():
                continue
            if future.cancelled():
                del self._compiling[spec]
            elif future.exception() is None:
                del self._compiling[spec]
                self._keep(spec, future.result())
            elif now - started > COMPILE_TIMEOUT_S:
                del self._compiling[spec]

    def _keep(self, spec: tuple[str, str], compiled: Any) -> None:
        self._compiled[spec] = compiled
        while len(self._compiled) > COMPILED_KEPT:
            self._compiled.popitem(last=False)

    def ready(self, spec: tuple[str, str]) -> bool:
        """Whether `compile(spec)` answers without waiting: compiled, failed, or past its time."""
        if spec in self._compiled:
            return True
        self._settle()  # (a compile given up on leaves, and is asked for again)
        if spec in self._compiled:
            return True
        pending = self._compiling.get(spec)
        if pending is None:  # compiled, then dropped from the kept ones since: once more
            self.prepare(spec)
            return False
        return pending[0].done() or time.monotonic() - pending[1] > COMPILE_TIMEOUT_S

    def wait(self, specs: Iterable[tuple[str, str]], seconds: float) -> None:
        """Up to `seconds`, until one of these grammars is ready (an engine with nothing else to
        do; not past a compile that ended, or it would spin)."""
        self._settle()
        futures = [self._compiling[s][0] for s in specs if s in self._compiling]
        futures = [future for future in futures if not future.done()]
        if futures:
            concurrent.futures.wait(futures, seconds, concurrent.futures.FIRST_COMPLETED)

    def _compile_jobs(self) -> None:
        assert self._jobs is not None
        while True:
            future, spec = self._jobs.get()
            if not future.set_running_or_notify_cancel():  # given up before it began
                continue
            try:
                future.set_result(self._compile_now(spec))
            except BaseException as err:  # the requests waiting for it learn why
                future.set_exception(err)

    def allowed(
        self, request_id: str, spec: tuple[str, str], output_ids: list[int]
    ) -> torch.Tensor:
        """The tokens that may come next, as an int32 bitmask [ceil(vocab / 32)]."""
        matcher = self.matchers.get(request_id) or self._matcher(request_id, spec, output_ids)
        import xgrammar  # (loaded already: the matcher is its)

        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask[0]

    def _matcher(self, request_id: str, spec: tuple[str, str], output_ids: list[int]) -> Any:
        """A new matcher for the sequence, having read the output it has so far."""
        compiled = self.compile(spec)  # first: without xgrammar, it says how to get it
        import xgrammar

        matcher = xgrammar.GrammarMatcher(compiled)
        for token in output_ids:
            if not matcher.accept_token(token):
                raise RequestError(f"output token {token} does not fit the response format")
        self.matchers[request_id] = matcher
        return matcher

    def advance(self, request_id: str, token: int) -> bool:
        """Reads the sampled token into the sequence's matcher (if it has one); True once the
        output must end: the grammar is complete (or, never with a bitmask applied, the token
        did not fit it)."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        return not matcher.accept_token(token) or matcher.is_terminated()

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def compile(self, spec: tuple[str, str]) -> Any:
        """The compiled grammar of `spec` (kind, text), waiting for its compile if it is under
        way (and started, if not); RequestError for one xgrammar refuses or one past its time."""
        self.prepare(spec)  # (which keeps a grammar whose compile has just ended)
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            return compiled
        future, started = self._compiling[spec]
        try:
            # (its error stays for every request that waited for it; `_settle` drops it later)
            compiled = future.result(max(0.0, started + COMPILE_TIMEOUT_S - time.monotonic()))
        except concurrent.futures.TimeoutError:
            # A compile under way goes on, and its grammar is kept if it ends (`_settle`); one
            # still queued (behind a slow one) never starts.
            future.cancel()
            raise RequestError(
                f"the response format did not compile within {COMPILE_TIMEOUT_S:g} s"
            ) from None
        del self._compiling[spec]
        self._keep(spec, compiled)
        return compiled

    def _compile_now(self, spec: tuple[str, str]) -> Any:
        """Compiles `spec` (on the compile thread)."""
        compiler = self._compiler or self._make_compiler()
        kind, text = spec
        try:
            if kind == "json_object":  # OpenAI's json_object: an object, spaced freely
                compiled = compiler.compile_json_schema('{"type": "object"}')
            elif kind == "json_schema":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                raise RequestError(f"unknown response format {kind!r}")
        except RuntimeError as err:  # xgrammar's word for a schema or pattern it cannot take
            raise RequestError(
                f"the {kind.replace('_', ' ')} cannot be used: {_reason(err)}"
            ) from None
        return compiled

    def _make_compiler(self) -> Any:
        try:
            import xgrammar
        except ImportError:
            raise RequestError(
                "structured output (response_format) needs xgrammar on the workers: "
                "pip install xgrammar"
            ) from None
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


def left_blocked(allowed: torch.Tensor, blocked: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens still to block beside a response format's bitmask. The format wins over
    min_tokens: where it allows only tokens min_tokens blocks (its end), they are blocked no
    more. Where it allows no token at all (a pattern nothing matches), RequestError: sampling
    from nothing would pick any token, outside the format."""
    if not bool(allowed.any()):
        raise RequestError("the response format allows no output here: nothing can match it")
    if not blocked:
        return blocked
    tokens = _unpacked(allowed)
    tokens[[t for t in blocked if t < len(tokens)]] = False
    return blocked if bool(tokens.any()) else ()


def _reason(err: RuntimeError) -> str:
    """xgrammar's message without its C++ prefix ("[18:59:19] /project/cpp/x.cc:83: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err).strip())


def apply_allowed(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on one row [vocab]: tokens whose bit is clear in `bitmask` (int32 words,
    token i at bit i % 32 of word i // 32) get -inf."""
    allowed = _unpacked(bitmask.to(logits.device))[: logits.shape[0]]
    logits.masked_fill_(~allowed, float("-inf"))


def _unpacked(bitmask: torch.Tensor) -> torch.Tensor:
    """A bitmask of int32 words as one bool per token (token i at bit i % 32 of word i // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(1) >> shifts) & 1).flatten().bool()
