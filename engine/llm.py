"""LLM: the offline Python API. `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer
from protocol.errors import RequestFailedError
from protocol.messages import RequestFailed
from protocol.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | Path, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = Tokenizer(self.engine.model_config.path)
        self._ids = itertools.count()

    def close(self) -> None:
        """Ends the tensor-parallel follower processes, if any (they also end with this one)."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion, batched; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        return self.generate_ids(token_lists, params)

    def chat(
        self,
        conversations: list[list[dict[str, Any]]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        return self.generate_ids([self.tokenizer.encode_chat(c) for c in conversations], params)

    def generate_ids(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        for ids, p in zip(prompts, params, strict=True):  # all refused before any is queued
            self.engine.check_request(ids, p)
        states: dict[str, RequestState] = {}
        results: dict[str, RequestOutput] = {}
        try:
            for ids, p in zip(prompts, params, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, ids, p)
                states[request_id] = RequestState(request_id, ids, p, self.tokenizer)
            while self.engine.has_unfinished:
                for update in self.engine.step():
                    if isinstance(update, RequestFailed):
                        raise RequestFailedError(f"request {update.request_id}: {update.reason}")
                    output, stop_string_hit = states[update.request_id].apply(update)
                    if stop_string_hit:
                        self.engine.abort(update.request_id)
                    if output.finished:
                        results[update.request_id] = output
        finally:  # on an error, the call's other requests end with it: none is left queued
            for request_id in states.keys() - results.keys():
                self.engine.abort(request_id)
        return [results[request_id] for request_id in states]
