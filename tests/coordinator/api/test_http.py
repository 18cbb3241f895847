"""Raw HTTP: SSE framing, every client error's status and body shape, the tokenizer routes,
health and readiness."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.servers import local_client

ERROR_KEYS = {"message", "type", "param", "code"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


DEEP_SCHEMA = '{"type": "array", "items": ' * 1100 + '{"type": "integer"}' + "}" * 1100


@pytest.fixture(scope="module")
def server(serve, tiny_llama):
    return serve(local_client(tiny_llama))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def events(response: httpx.Response) -> list[str]:
    """The stream's raw `data:` payloads, checking the framing on the way."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    frames = body[:-2].split("\n\n")
    assert all(frame.startswith("data: ") and "\n" not in frame for frame in frames)
    return [frame.removeprefix("data: ") for frame in frames]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_completion_stream_framing(http) -> None:
    payload = {"prompt": "The quick", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**payload, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = events(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    whole = http.post("/v1/completions", json=payload).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert whole["usage"]["completion_tokens"] == 5


def test_chat_stream_framing_with_usage(http) -> None:
    payload = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=payload) as response:
        data = events(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["usage"]["total_tokens"] == sum(
        chunks[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens")
    )


LONG_PROMPT = list(range(3, 300)) * 2  # 594 tokens; the context holds 512

BAD_REQUESTS = [
    # (path, body, status, param)
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": "many"}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),  # past signed 64 bits
    ("/v1/completions", {"prompt": "hi", "stream_options": {}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),  # as in vLLM: a whole response's field
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias.x"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [WEATHER]}, 400, "tool_choice"),  # "auto" by default
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),  # no tools
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                              "tool_choice": "required", "response_format": {
                                  "type": "json_object"}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                              "tool_choice": {"type": "function"}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "auto"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"tokenize": True}}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x",
                              "audio": {"id": "a"}}]}, 400, "messages.0.audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": ["5"]}, 400, "tokens.0"),
    # max_tokens is cut to the context left; min_tokens past it cannot be met.
    ("/v1/completions", {"prompt": LONG_PROMPT[:497], "max_tokens": 100, "min_tokens": 50},
     400, "min_tokens"),
    # The field, not pydantic's steps through a union ("stop.str", "tool_choice.literal[...]").
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content"),
    # Names the functions that hand the options on take themselves (was a 500).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "chat_template_kwargs": {"tokenizer": None}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"self": 1}}, 400, "chat_template_kwargs"),
    # A response format no response could follow, or that would stall the worker compiling it
    # (each was a 500, or an engine thread busy for minutes).
    ("/v1/completions", b'{"prompt": "hi", "structured_outputs": {"regex": "\\ud800"}}', 400,
     "response_format"),
    ("/v1/completions", b'{"prompt": "hi", "structured_outputs": {"choice": ["\\udfff"]}}', 400,
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": DEEP_SCHEMA}}, 400,
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a" * 70_000}}, 400,
     "response_format"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests(http, path, body, status, param) -> None:
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert_error(response, status, param)


def test_unsupported_parameter_message_says_so(http) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi", "suffix": "!"})
    assert "not supported" in assert_error(response, 400, "suffix")["message"]


def test_echo_puts_each_prompt_before_its_completion(http) -> None:
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json={**base, "prompt": ["The quick", "0123"]}).json()
    echoed = http.post(
        "/v1/completions", json={**base, "prompt": ["The quick", "0123"], "echo": True, "n": 2}
    ).json()
    texts = {c["index"]: c["text"] for c in echoed["choices"]}
    assert texts[0] == texts[1] == "The quick" + plain["choices"][0]["text"]
    assert texts[2] == texts[3] == "0123" + plain["choices"][1]["text"]
    assert echoed["usage"]["completion_tokens"] == 4 * 4  # the prompt is not output
    body = {**base, "prompt": "The quick", "echo": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [json.loads(d) for d in events(response)[:-1]]
    assert chunks[0]["choices"][0]["text"] == "The quick"
    assert "".join(c["choices"][0]["text"] for c in chunks) == texts[0]
    ids = http.post("/tokenize", json={"prompt": "The quick"}).json()["tokens"]
    by_ids = http.post("/v1/completions", json={**base, "prompt": ids, "echo": True}).json()
    assert by_ids["choices"][0]["text"] == texts[0]  # token ids: decoded


def test_echo_with_logprobs_scores_the_prompt_as_prompt_logprobs_does(http) -> None:
    """The legacy completions API's echo with logprobs (what evaluation harnesses send to
    score a text): the prompt's tokens come first in the logprobs, the first without one; the
    same numbers as vLLM's prompt_logprobs; streamed, the prompt's come in the first chunk."""
    prompt = list(range(5, 15))
    base = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json={**base, "logprobs": 2}).json()["choices"][0]
    assert "prompt_logprobs" not in plain  # absent unless asked for
    echoed = http.post("/v1/completions", json={**base, "logprobs": 2, "echo": True}).json()
    choice = echoed["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])  # 2 and the token itself
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert lp["token_logprobs"][len(prompt) :] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"][len(prompt)] == len(choice["text"]) - len(plain["text"])
    scored = http.post("/v1/completions", json={**base, "prompt_logprobs": 2}).json()
    positions = scored["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(prompt) and positions[0] is None
    prompt_part = lp["token_logprobs"][1 : len(prompt)]
    for token, logprob, here in zip(prompt[1:], prompt_part, positions[1:], strict=True):
        mine = here.pop(str(token))
        assert mine["logprob"] == logprob and mine["rank"] >= 1
        others = sorted(entry["rank"] for entry in here.values())  # the 2 likeliest but it
        assert others == ([1, 2] if mine["rank"] > 2 else [3 - mine["rank"]])
    with http.stream(
        "POST", "/v1/completions", json={**base, "logprobs": 2, "echo": True, "stream": True}
    ) as response:
        chunks = [json.loads(d)["choices"][0] for d in events(response)[:-1]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    assert chunks[0]["logprobs"]["tokens"] == lp["tokens"][: len(prompt)]


def test_echo_with_logprobs_of_a_one_token_prompt(http) -> None:
    base = {"prompt": [7], "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True}
    whole = http.post("/v1/completions", json=base).json()["choices"][0]
    assert whole["logprobs"]["token_logprobs"][0] is None
    assert len(whole["logprobs"]["tokens"]) == 3
    with http.stream("POST", "/v1/completions", json={**base, "stream": True}) as response:
        chunks = [json.loads(d)["choices"][0] for d in events(response)[:-1]]
    assert "".join(c["text"] for c in chunks) == whole["text"]  # the echo included
    scored = http.post("/v1/completions", json={**base, "prompt_logprobs": 0}).json()
    assert scored["choices"][0]["prompt_logprobs"] == [None]


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(http) -> None:
    """What scoring clients send (vLLM takes it): echo, logprobs and max_tokens 0 return the
    prompt with its logprobs, no completion, finish_reason "length", no completion tokens."""
    prompt = list(range(5, 15))
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    reply = http.post("/v1/completions", json=body).json()
    choice, usage = reply["choices"][0], reply["usage"]
    longer = http.post("/v1/completions", json={**body, "max_tokens": 2}).json()["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == len(prompt) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == longer["logprobs"]["token_logprobs"][:10]
    assert longer["text"].startswith(choice["text"]) and choice["text"] != longer["text"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(prompt)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(d)["choices"][0] for d in events(response)[:-1]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == choice[
        "logprobs"
    ]["tokens"]
    assert chunks[-1]["finish_reason"] == "length"
    scored = http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "prompt_logprobs": 1}
    ).json()["choices"][0]
    assert scored["text"] == "" and len(scored["prompt_logprobs"]) == len(prompt)


def test_chat_prompt_logprobs_score_the_rendered_conversation(http) -> None:
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
            "temperature": 0}  # fmt: skip
    plain = http.post("/v1/chat/completions", json=body).json()
    scored = http.post("/v1/chat/completions", json={**body, "prompt_logprobs": 0}).json()
    assert "prompt_logprobs" not in plain and plain["choices"] == scored["choices"]
    positions = scored["prompt_logprobs"]
    assert len(positions) == scored["usage"]["prompt_tokens"] and positions[0] is None
    assert all(len(here) == 1 for here in positions[1:])  # the token alone: 0 alternatives


def test_neutral_values_of_unimplemented_parameters_pass(http) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "echo": False, "logit_bias": {}, "best_of": 1,
            "suffix": None, "user": "someone"}  # fmt: skip
    assert http.post("/v1/completions", json=body).status_code == 200


def test_an_sdk_dump_of_an_earlier_reply_is_taken_back(http) -> None:
    # What `messages.append(reply.choices[0].message.model_dump())` sends with the openai SDK.
    reply = {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None,
             "audio": None, "annotations": [], "function_call": None}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "hi"}, reply,
                         {"role": "user", "content": "again"}],
            "max_tokens": 2, "stream": True, "stream_options": {"include_usage": None},
            "store": False, "metadata": {"run": "1"}, "modalities": ["text"]}  # fmt: skip
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    plain = {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "again"}]}  # fmt: skip
    assert _chat_tokens(http, body) == _chat_tokens(http, plain)


def test_tool_calls_and_tool_turns_reach_the_template(http) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"messages": messages, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 2}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    prompt = http.post("/detokenize", json={"tokens": _chat_tokens(http, body)}).json()["prompt"]
    assert '{"name": "get_weather", "description": "The weather in a city"' in prompt  # the tool
    # The call's arguments reach the template as a mapping, as templates expect.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert "\ntool\nsunny\n" in prompt  # (special tokens are left out of the text)


def test_template_options_reach_the_template(http) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    prompt = http.post("/detokenize", json={"tokens": _chat_tokens(http, body)}).json()["prompt"]
    assert prompt.endswith("user\nhi\n")  # no assistant turn opened


def _chat_tokens(http, body: dict) -> list[int]:
    """The prompt a chat request's body renders to, from /tokenize with the same messages and
    template options; checked against what the chat route counted."""
    options = ("tools", "add_generation_prompt", "chat_template_kwargs")
    asked = {"messages": body["messages"], **{k: body[k] for k in options if k in body}}
    tokens = http.post("/tokenize", json=asked).json()["tokens"]
    response = http.post("/v1/chat/completions", json={**body, "max_tokens": 1, "stream": False,
                                                      "stream_options": None})  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(tokens)
    return tokens


def test_unknown_route_and_method(http) -> None:
    assert_error(http.get("/v2/anything"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_tokenize_round_trip(http) -> None:
    tokens = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "The quick brown fox"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    prompt = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "hi" in prompt and "assistant" in prompt
    assert_error(http.post("/tokenize", json={}), 400)


def test_health_and_readiness(http) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json() == {"status": "ready"}
    for path in ("/health", "/ready"):  # probes that send HEAD
        head = http.head(path)
        assert (head.status_code, head.content) == (200, b"")


def test_json_sent_without_its_content_type_is_told_so(http) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    response = http.post("/v1/completions", content=body, headers={"content-type": "text/plain"})
    message = assert_error(response, 400)["message"]
    assert "Content-Type: application/json" in message and "text/plain" in message


def test_an_output_past_the_context_stops_at_its_end(http) -> None:
    """As vLLM does: a prompt plus max_tokens over the context is served, and stops where the
    context ends ("length"); max_tokens over the whole context is still a 400 (above)."""
    prompt = list(range(3, 300)) + list(range(3, 200))  # 494 tokens of the 512
    for path, extra in (("/v1/completions", {"prompt": prompt, "max_tokens": 100}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                  "max_completion_tokens": 512})):  # fmt: skip
        body = {**extra, "temperature": 0, "ignore_eos": True}
        reply = http.post(path, json=body).json()
        usage = reply["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 512, reply
        assert reply["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_put_usage_on_every_chunk(http) -> None:
    for path, extra in (("/v1/completions", {"prompt": "The quick", "n": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "hi"}]})):  # fmt: skip
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {**extra, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": options}  # fmt: skip
        with http.stream("POST", path, json=body) as response:
            chunks = [json.loads(d) for d in events(response)[:-1]]
        *per_choice, last = chunks
        prompt_tokens = last["usage"]["prompt_tokens"]  # one prompt, counted once
        seen: dict[int, int] = {}
        for chunk in per_choice:
            [choice] = chunk["choices"]
            usage = chunk["usage"]
            assert usage["prompt_tokens"] == prompt_tokens
            assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
            assert usage["completion_tokens"] >= seen.get(choice["index"], 0)  # so far
            seen[choice["index"]] = usage["completion_tokens"]
        assert seen == {i: 4 for i in range(extra.get("n", 1))}
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 * len(seen)


def test_probes_clients_send_to_vllm(http) -> None:
    assert http.get("/ping").json() == http.post("/ping").json() == {"status": "ok"}
    assert isinstance(http.get("/version").json()["version"], str)


def test_bookkeeping_fields_of_newer_clients_are_accepted(http) -> None:
    body = {"prompt": "hi", "max_tokens": 1, "prompt_cache_key": "user-7",
            "safety_identifier": "hash-of-user", "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert events(response)[-1] == "[DONE]"


def test_response_formats_hold_the_output(http) -> None:
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2]}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0}
    formats = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    reply = http.post("/v1/chat/completions", json={**base, "response_format": formats}).json()
    assert json.loads(reply["choices"][0]["message"]["content"]) in ({"n": 1}, {"n": 2})
    assert reply["choices"][0]["finish_reason"] == "stop"
    choice = {"prompt": "x", "max_tokens": 10, "structured_outputs": {"choice": ["up", "down"]}}
    for stream in (False, True):
        body = {**choice, "stream": stream}
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as response:
                chunks = [json.loads(d) for d in events(response)[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
        else:
            text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert text in ("up", "down")
    plain = {**base, "response_format": {"type": "text"}}
    assert http.post("/v1/chat/completions", json=plain).status_code == 200


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
    ],
)  # fmt: skip
def test_response_format_errors(http, extra, param) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_a_schema_the_workers_cannot_compile_is_a_400_not_a_hang(http) -> None:
    pytest.importorskip("xgrammar")
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}},
    }
    error = assert_error(http.post("/v1/completions", json=body), 400)
    assert error["message"].startswith("the json schema cannot be used: ")
    assert "/project/cpp" not in error["message"]  # xgrammar's source position, dropped
    # Streamed, the response waits for the first output: the same 400, not a 200 stream
    # carrying an error event.
    streamed = http.post("/v1/completions", json={**body, "stream": True})
    assert assert_error(streamed, 400)["message"] == error["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
            "structured_outputs": {"regex": "(unclosed"}}  # fmt: skip
    refused = assert_error(http.post("/v1/chat/completions", json=chat), 400)
    assert "regex cannot be used" in refused["message"]


def test_tool_choice_required_takes_parameters_that_refer_to_their_own_defs(http) -> None:
    """A tool's parameters with "$ref": "#/$defs/..." (pydantic writes them so) were resolved
    against the calls' schema around them: a 400 for a valid tool."""
    pytest.importorskip("xgrammar")
    city = {"type": "string", "enum": ["Paris", "Oslo"]}
    parameters = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/City"}},
        "required": ["where"],
        "additionalProperties": False,
        "$defs": {"City": city},
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}},
             {"type": "function", "function": {"name": "noop"}}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": tools,
            "tool_choice": "required", "max_tokens": 60, "temperature": 0}  # fmt: skip
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    for call in reply.json()["choices"][0]["message"]["tool_calls"]:
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert arguments in ({"where": "Paris"}, {"where": "Oslo"})


def test_tool_choice_required_makes_calls_to_the_tools_with_arguments_that_fit(http) -> None:
    """tool_choice "required": the reply is one call or more, each naming one of the tools
    with arguments held to its parameters (finish_reason "tool_calls"); parallel_tool_calls
    false makes it exactly one; streamed, the calls come whole; a reply cut short by
    max_tokens holds no calls and stays text."""
    pytest.importorskip("xgrammar")
    cities = {"type": "string", "enum": ["Paris", "Oslo"]}
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"city": cities}, "required": ["city"],
            "additionalProperties": False}}}
        for name in ("get_weather", "get_time")
    ]  # fmt: skip
    body = {"messages": [{"role": "user", "content": "weather and time in Paris?"}],
            "tools": tools, "tool_choice": "required", "max_tokens": 60,
            "temperature": 0}  # fmt: skip

    def check(calls: list[dict]) -> None:
        assert calls
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function"
            assert call["function"]["name"] in ("get_weather", "get_time")
            assert json.loads(call["function"]["arguments"]) in (
                {"city": "Paris"},
                {"city": "Oslo"},
            )

    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    check(choice["message"]["tool_calls"])
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(d) for d in events(response)[:-1]]
    [last] = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert last["finish_reason"] == "tool_calls"
    streamed = last["delta"]["tool_calls"]
    assert [c["index"] for c in streamed] == list(range(len(streamed)))
    assert [c["function"] for c in streamed] == [
        c["function"] for c in choice["message"]["tool_calls"]
    ]
    # with logprobs: the streamed reply, sent whole, carries every token's (it carried none)
    scored = {**body, "logprobs": True}
    whole = http.post("/v1/chat/completions", json=scored).json()["choices"][0]["logprobs"]
    with http.stream("POST", "/v1/chat/completions", json={**scored, "stream": True}) as response:
        chunks = [json.loads(d) for d in events(response)[:-1]]
    [last] = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert whole["content"] and last["logprobs"]["content"] == whole["content"]
    one = http.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False}).json()
    [call] = one["choices"][0]["message"]["tool_calls"]
    check([call])
    short = http.post("/v1/chat/completions", json={**body, "max_tokens": 3}).json()["choices"][0]
    assert short["finish_reason"] == "length" and short["message"]["tool_calls"] == []
    assert short["message"]["content"].startswith("[")


def test_a_named_tool_choice_forces_one_call_with_arguments_that_fit(http) -> None:
    """OpenAI's forced call: the reply is one call to the named function, its arguments held
    to the function's parameters (finish_reason "stop"); streamed, the call comes whole."""
    pytest.importorskip("xgrammar")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [weather],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 30, "temperature": 0}  # fmt: skip
    reply = http.post("/v1/chat/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) in ({"city": "Paris"}, {"city": "Oslo"})
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(d) for d in events(response)[:-1]]
    deltas = [c["choices"][0] for c in chunks]
    assert deltas[0]["delta"]["role"] == "assistant"
    [last] = [d for d in deltas if d["delta"].get("tool_calls")]
    assert last["finish_reason"] == "stop"
    streamed = last["delta"]["tool_calls"][0]["function"]
    assert streamed["name"] == "get_weather"
    assert streamed["arguments"] == call["function"]["arguments"]


def test_an_assistant_turn_with_arguments_nested_past_the_parser_is_rendered_as_sent(http) -> None:
    arguments = "[" * 1100 + "]" * 1100  # (json.loads raised RecursionError: a 500)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "ok", "tool_calls": [call]}]  # fmt: skip
    assert http.post("/tokenize", json={"messages": messages}).status_code == 200


def test_telemetry_of_the_one_local_engine(http) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json=body).status_code == 200
    reply = http.get("/admin/telemetry", params={"worker": "colocated-0", "limit": 1})
    assert reply.status_code == 200, reply.text
    [(name, log)] = reply.json()["workers"].items()
    assert name == "colocated-0" and len(log["steps"]) == 1 and log["steps_total"] >= 2
    assert http.get("/admin/telemetry", params={"worker": "engine"}).status_code == 404
