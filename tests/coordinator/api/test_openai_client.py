"""The official openai client against a running server: completions and chat, streamed and not,
usage, n, stop strings, seeds and logprobs; greedy text must equal offline generation."""

from __future__ import annotations

import openai
import pytest

from engine.llm import LLM
from protocol.sampling import SamplingParams
from tests.support.servers import local_client

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Paged attention stores keys"}]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(serve, tiny_llama):
    return serve(local_client(tiny_llama))


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256)


def greedy() -> dict:
    return {"model": "tiny", "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_lists_the_model(api) -> None:
    assert [m.id for m in api.models.list().data] == ["tiny"]
    assert api.models.retrieve("tiny").id == "tiny"


def test_completion_matches_offline_generation(api, offline) -> None:
    want = offline.generate([PROMPT], GREEDY)[0]
    got = api.completions.create(prompt=PROMPT, **greedy())
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12


def test_completion_stream_carries_the_same_text_and_usage(api, offline) -> None:
    want = offline.generate([PROMPT], GREEDY)[0]
    chunks = list(
        api.completions.create(
            prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **greedy()
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_and_several_prompts(api, offline) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    want = offline.generate_ids(prompts, GREEDY)
    got = api.completions.create(prompt=prompts, **greedy())
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert got.usage.prompt_tokens == 7 and got.usage.completion_tokens == 24


def test_chat_matches_offline_chat(api, offline) -> None:
    want = offline.chat([MESSAGES], GREEDY)[0]
    got = api.chat.completions.create(messages=MESSAGES, **greedy())
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 12

    stream = api.chat.completions.create(
        messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **greedy()
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_max_completion_tokens(api) -> None:
    got = api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"


def test_n_choices_follow_their_seeds(api) -> None:
    sampled = {
        "model": "tiny", "max_tokens": 10, "temperature": 1.0, "seed": 7,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    two = api.completions.create(prompt=PROMPT, n=2, **sampled)
    one = api.completions.create(prompt=PROMPT, n=1, **sampled)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text  # choice 0 draws with the seed itself
    assert two.choices[0].text != two.choices[1].text  # choice 1 with seed + 1
    assert two.usage.completion_tokens == 20

    stream = api.chat.completions.create(messages=MESSAGES, n=2, stream=True, **sampled)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    chat_two = api.chat.completions.create(messages=MESSAGES, n=2, **sampled)
    assert [texts[0], texts[1]] == [c.message.content for c in chat_two.choices]


def test_seed_reproduces_sampled_text(api) -> None:
    def sample(seed: int) -> str:
        got = api.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed
        )
        return got.choices[0].text

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_stop_string_trims_and_reports(api, offline) -> None:
    full = offline.generate([PROMPT], GREEDY)[0].text
    stop = full[3:5]
    got = api.completions.create(prompt=PROMPT, stop=[stop], **greedy())
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"

    stream = api.completions.create(prompt=PROMPT, stop=stop, stream=True, **greedy())
    assert "".join(c.choices[0].text for c in stream) == full[: full.index(stop)]


def test_completion_logprobs(api) -> None:
    got = api.completions.create(prompt=PROMPT, logprobs=3, **greedy())
    logprobs = got.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    # Greedy picks the most likely token: its logprob is the best of the top ones.
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert logprobs.text_offset[0] == 0


@pytest.mark.parametrize("k", [0, 1])
def test_completion_top_logprobs_hold_the_sampled_token(api, k) -> None:
    # Sampled hot, the chosen token is often not the most likely one: the completions API
    # still lists it (up to logprobs + 1 entries), with its own logprob.
    hot = {**greedy(), "max_tokens": 24, "temperature": 2.0, "seed": 7}
    got = api.completions.create(prompt=PROMPT, logprobs=k, **hot).choices[0].logprobs
    assert len(got.tokens) == 24
    for token, chosen, top in zip(got.tokens, got.token_logprobs, got.top_logprobs, strict=True):
        assert token in top
        if token != "\ufffd":  # (partial UTF-8 tokens share that text: the likeliest keeps it)
            assert top[token] == pytest.approx(chosen, abs=1e-6)
        assert len(top) <= k + 1
    assert any(len(top) == k + 1 for top in got.top_logprobs) or k == 0


def test_chat_logprobs(api) -> None:
    got = api.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **greedy())
    content = got.choices[0].logprobs.content
    assert len(content) == 12
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)


def test_errors_surface_as_openai_exceptions(api) -> None:
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=-1)
    assert caught.value.body["param"] == "temperature"
