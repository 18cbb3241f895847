"""RequestState: the text streamed in deltas equals the whole text, stop strings cut it where
a plain search of the whole text would, and an output's tokens and text stay as they were when
it was made while the request goes on (they are views, not copies). Fake tokenizer: token n
decodes to one letter, chr(ord("a") + n % 26)."""

from __future__ import annotations

import random

import pytest

from engine.output_processor import RequestState
from protocol.messages import TokenUpdate
from protocol.sampling import FinishReason, SamplingParams
from tests.support.fake_workers import FakeTokenizer, text_of


def feed(state: RequestState, chunks: list[list[int]], last: FinishReason | None):
    outputs, first = [], 0
    for i, chunk in enumerate(chunks):
        finish = last if i == len(chunks) - 1 else None
        update = TokenUpdate("r", first, chunk, [None] * len(chunk), finish)
        output, hit = state.apply(update)
        outputs.append(output)
        first += len(chunk)
        if hit:
            break
    return outputs


def expected_text(tokens: list[int], chunks: list[list[int]], stops: list[str], keep: bool):
    """The text as a plain search finds it: after each chunk, the first stop string that
    starts in the part that could not have held a whole one before."""
    text, holdback = "", max((len(s) for s in stops), default=1) - 1
    for chunk in chunks:
        scan_from = max(0, len(text) - holdback)
        text += text_of(chunk)
        found = sorted((text.find(s, scan_from), s) for s in stops if text.find(s, scan_from) >= 0)
        if found:
            at, stop = found[0]
            return text[: at + len(stop) if keep else at], stop
    return text, None


@pytest.mark.parametrize("seed", range(200))
def test_deltas_and_stop_strings_match_a_search_of_the_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]  # letters a-d: stops hit
    stops = ["".join(rng.choice("abcd") for _ in range(rng.randrange(1, 5)))
             for _ in range(rng.randrange(0, 3))]  # fmt: skip
    keep = rng.random() < 0.5
    cuts = sorted(rng.sample(range(1, len(tokens)), min(len(tokens) - 1, rng.randrange(0, 20))))
    chunks = [tokens[a:b] for a, b in zip([0, *cuts], [*cuts, len(tokens)], strict=True)]
    params = SamplingParams(stop=stops, include_stop_str_in_output=keep)
    state = RequestState("r", [1, 2], params, FakeTokenizer())  # type: ignore[arg-type]

    outputs = feed(state, chunks, FinishReason.LENGTH)

    text, stop = expected_text(tokens, chunks, stops, keep)
    final = outputs[-1]
    assert final.finished and final.text == text
    assert final.stop_reason == stop
    assert "".join(out.delta_text for out in outputs) == text
    streamed = 0
    for out in outputs:  # each output still shows the request as it was when it was made
        streamed += len(out.delta_token_ids)
        assert list(out.token_ids) == tokens[:streamed] == out.token_ids
        assert text.startswith(out.text[: len(text)])


def test_a_long_request_keeps_a_bounded_tail_of_its_text() -> None:
    """What each output costs must not grow with the output: no copy of all tokens or text."""
    state = RequestState("r", [1], SamplingParams(stop=["zzzz"]), FakeTokenizer())  # type: ignore[arg-type]
    outputs = feed(state, [[i % 25] for i in range(20_000)], FinishReason.LENGTH)
    assert len(state.recent) <= 3 + 1  # the holdback and the newest piece
    assert len(outputs[99].token_ids) == 100 and outputs[99].token_ids[-1] == 99 % 25
    assert outputs[-1].text == text_of([i % 25 for i in range(20_000)])
    assert type(outputs[-1].token_ids) is list  # the last output's: ready for json.dumps
    with pytest.raises(IndexError):
        outputs[99].token_ids[100]  # noqa: B018 (past the view, not past the list it shares)


def test_stop_strings_wait_for_min_tokens_as_stop_tokens_do() -> None:
    """min_tokens=5, stop "b", and "b" as the first token: the request ended after one token
    (EOS and stop ids are masked until min_tokens; vLLM checks stop strings only then too)."""
    params = SamplingParams(max_tokens=8, min_tokens=5, stop=["b"])
    state = RequestState("r", [0], params, FakeTokenizer())  # type: ignore[arg-type]
    outputs = feed(state, [[1], [0], [2], [3], [1], [0]], FinishReason.LENGTH)  # b a c d b a
    final = outputs[-1]
    assert len(final.token_ids) == 5 and final.finish_reason == "stop"
    assert final.text == "bacd" and final.stop_reason == "b"  # the fifth token's "b" ends it
