"""TrackedRequest: output kept by position across workers and retries (fake tokenizer: token n
decodes to one letter, 10 -> "k", 11 -> "l", ...)."""

from __future__ import annotations

import asyncio

from coordinator.request_state import TrackedRequest
from engine.outputs import RequestOutput, StreamFailed
from protocol.errors import EngineDeadError
from protocol.messages import TokenUpdate, WorkRequest
from protocol.sampling import FinishReason, PromptLogprob, SamplingParams, TokenLogprobs
from tests.support.fake_workers import FakeTokenizer

PROMPT = [1, 2, 3]


def tracked(params: SamplingParams | None = None) -> TrackedRequest:
    request = TrackedRequest("r", PROMPT, params or SamplingParams(), FakeTokenizer())  # type: ignore[arg-type]
    request.next_attempt()
    return request


def update(
    first_index: int,
    token_ids: list[int],
    finish: FinishReason | None = None,
    logprobs: list[TokenLogprobs | None] | None = None,
    **fields: object,
) -> TokenUpdate:
    logprobs = logprobs or [None] * len(token_ids)
    return TokenUpdate("r#1", first_index, token_ids, logprobs, finish, **fields)  # type: ignore[arg-type]


def drain(request: TrackedRequest) -> list[RequestOutput | StreamFailed]:
    items = []
    while not request.stream.empty():
        items.append(request.stream.get_nowait())
    return items


def test_first_token_then_the_decode_workers_copy_of_it() -> None:
    request = tracked()
    request.accept_first(0, 10, None)
    assert request.accept(update(0, [10, 11])) is False
    first, second = drain(request)
    assert (first.delta_token_ids, first.delta_text) == ([10], "k")
    assert (second.delta_token_ids, second.delta_text, second.token_ids) == ([11], "l", [10, 11])
    assert request.output_ids == [10, 11]


SCORES = [None, PromptLogprob(-1.5, 2, []), PromptLogprob(-0.5, 1, [])]


def test_the_decode_workers_tokens_wait_for_the_prompts_scores() -> None:
    """With prompt logprobs asked for, a decode worker that reports (even finishes) before its
    prefill worker answers is held: every output, the first too, carries the prompt's scores."""
    request = tracked(SamplingParams(prompt_logprobs=0, max_tokens=2))
    request.awaits_prompt = True  # (the coordinator sets it as the prefill call leaves)
    assert request.accept(update(0, [10, 11], FinishReason.LENGTH)) is False
    assert drain(request) == [] and not request.finished
    request.accept_prompt(SCORES)
    request.accept_first(0, 10, None)  # the prefill worker's copy: a repeat by now
    [output] = drain(request)
    assert output.token_ids == [10, 11] and output.finished
    assert output.prompt_logprobs == SCORES


def test_a_new_attempt_drops_the_updates_held_for_scores() -> None:
    request = tracked(SamplingParams(prompt_logprobs=0))
    request.awaits_prompt = True
    request.accept(update(0, [10]))
    request.next_attempt()  # the prefill failed: its decode worker's tokens go with it
    request.accept_prompt(None)
    assert drain(request) == [] and request.output_ids == []


def test_repeated_batch_is_dropped() -> None:
    request = tracked()
    request.accept(update(0, [10, 11]))
    request.accept(update(0, [10, 11]))
    request.accept(update(1, [11, 12]))
    assert [o.delta_token_ids for o in drain(request)] == [[10, 11], [12]]
    assert request.output_ids == [10, 11, 12]


def test_finish_reported_with_tokens_already_seen_still_finishes() -> None:
    request = tracked()
    request.accept(update(0, [10, 11]))
    request.accept(update(0, [10, 11], FinishReason.LENGTH))
    _, last = drain(request)
    assert (last.delta_token_ids, last.token_ids, last.finish_reason) == ([], [10, 11], "length")
    assert request.finished
    assert request.ended.is_set()


def test_first_token_at_the_wrong_position_or_after_the_end_is_ignored() -> None:
    request = tracked()
    request.accept_first(1, 11, None)  # position 0 has not arrived
    assert drain(request) == []
    request.accept(update(0, [10], FinishReason.STOP, stop_token_id=10))
    drain(request)
    request.accept_first(1, 11, None)
    assert drain(request) == []
    assert request.output_ids == [10]


def test_gap_loses_the_request() -> None:
    request = tracked()
    request.accept(update(0, [10]))
    drain(request)
    assert request.accept(update(2, [12, 13])) is False
    assert request.lost_reason == "token 1 never arrived"
    assert request.ended.is_set()
    assert not request.finished
    assert drain(request) == []
    assert request.output_ids == [10]


def test_next_attempt_has_a_new_id_and_carries_the_output() -> None:
    params = SamplingParams(max_tokens=8)
    request = TrackedRequest("r", PROMPT, params, FakeTokenizer())  # type: ignore[arg-type]
    assert request.next_attempt() == WorkRequest("r#1", PROMPT, params, [])
    request.accept(update(0, [10, 11]))
    request.lose("worker died")
    work = request.next_attempt()
    assert work == WorkRequest("r#2", PROMPT, params, [10, 11])
    assert request.worker_request_id == "r#2"
    assert (request.lost_reason, request.ended.is_set()) == (None, False)
    request.accept(update(2, [12]))
    assert work.output_ids == [10, 11]  # the attempt's copy, not the live list


def test_lose_after_finish_changes_nothing() -> None:
    request = tracked()
    request.accept(update(0, [10], FinishReason.LENGTH))
    request.lose("late failure")
    assert request.lost_reason is None


def test_stop_string_hit_returns_true_and_trims_the_text() -> None:
    request = tracked(SamplingParams(stop=("mn",)))
    assert request.accept(update(0, [10, 11, 12])) is False
    assert request.accept(update(3, [13, 14])) is True
    outputs = drain(request)
    assert "".join(o.delta_text for o in outputs) == "kl"
    assert (outputs[-1].text, outputs[-1].finish_reason, outputs[-1].stop_reason) == (
        "kl", "stop", "mn"
    )  # fmt: skip
    assert request.finished
    assert request.ended.is_set()


def test_logprobs_follow_the_tokens_kept() -> None:
    request = tracked(SamplingParams(logprobs=0))
    first, copy, second = TokenLogprobs(-0.1, []), TokenLogprobs(-9.0, []), TokenLogprobs(-0.2, [])
    request.accept_first(0, 10, first)
    request.accept(update(0, [10, 11], logprobs=[copy, second]))
    assert drain(request)[-1].logprobs == [first, second]


def test_queue_time_and_cached_tokens_reach_the_output() -> None:
    request = tracked()
    request.accept(update(0, [10], queue_seconds=0.5, num_cached_tokens=2))
    request.accept(update(1, [11], queue_seconds=9.0, num_cached_tokens=1))
    outputs = drain(request)
    assert [o.queue_seconds for o in outputs] == [0.5, 0.5]  # the first worker's queue time
    assert [o.num_cached_tokens for o in outputs] == [2, 2]  # never goes down


def test_fail_puts_the_error_on_the_stream() -> None:
    request = tracked()
    err = EngineDeadError("every retry failed")
    request.fail(err)
    [item] = drain(request)
    assert isinstance(item, StreamFailed)
    assert item.error is err
    assert request.ended.is_set()


def test_ended_wakes_a_waiter() -> None:
    async def main() -> str | None:
        request = tracked()
        waiter = asyncio.create_task(request.ended.wait())
        await asyncio.sleep(0)
        request.accept(update(1, [11]))  # a gap
        await asyncio.wait_for(waiter, 1.0)
        return request.lost_reason

    assert asyncio.run(main()) == "token 0 never arrived"


def held(interval: int, params: SamplingParams | None = None) -> TrackedRequest:
    request = TrackedRequest("r", PROMPT, params or SamplingParams(), FakeTokenizer(), interval)  # type: ignore[arg-type]
    request.next_attempt()
    return request


def test_a_stream_interval_holds_tokens_between_the_first_and_the_last() -> None:
    request = held(4)
    for i, token in enumerate(range(10, 20)):
        request.accept(update(i, [token]))
    request.accept(update(10, [20], FinishReason.LENGTH))
    deltas = [o.delta_token_ids for o in drain(request)]
    assert deltas == [[10], [11, 12, 13, 14], [15, 16, 17, 18], [19, 20]]
    assert request.output_ids == list(range(10, 21))  # a retry resumes after every token


def test_held_tokens_reach_the_client_before_a_failure() -> None:
    request = held(8)
    request.accept(update(0, [10]))
    request.accept(update(1, [11, 12]))
    request.fail(EngineDeadError("gone"))
    first, second, failure = drain(request)
    assert (first.delta_token_ids, second.delta_token_ids) == ([10], [11, 12])
    assert second.text == "klm" and isinstance(failure, StreamFailed)


def test_held_tokens_survive_a_lost_attempt() -> None:
    request = held(4)
    request.accept(update(0, [10]))
    request.accept(update(1, [11]))
    request.lose("worker died")
    work = request.next_attempt()
    assert work.output_ids == [10, 11]
    request.accept(TokenUpdate("r#2", 2, [12, 13, 14], [None] * 3, None))  # type: ignore[arg-type]
    assert [o.delta_token_ids for o in drain(request)] == [[10], [11, 12, 13, 14]]


def test_a_stop_string_in_held_tokens_ends_the_request_when_they_go_out() -> None:
    request = held(4, SamplingParams(stop=["lm"]))
    request.accept(update(0, [10]))
    assert request.accept(update(1, [11])) is False  # held: not looked at yet
    assert request.accept(update(2, [12])) is False
    assert request.accept(update(3, [13, 14])) is True  # out: "klmno" holds the stop string
    *_, last = drain(request)
    assert (last.text, last.finish_reason, last.stop_reason) == ("k", "stop", "lm")
