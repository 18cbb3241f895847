"""Running load against the fake server: what is sent, when, how many at once, and when it stops."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from loadtest.arrivals import send_offsets
from tests.support.bench import bench

SLACK = 0.050  # seconds of overhead allowed on one measurement, on a busy 2-core machine
SHORT = ("--random-input-len", "6", "--random-output-len", "3")


def test_payload_carries_model_lengths_sampling_and_usage_request(serve) -> None:
    server = serve(model="served-model")
    bench(
        server.url, *SHORT, "--num-prompts", "2", "--temperature", "0.7", "--top-p", "0.9",
        "--top-k", "5", "--ignore-eos",
    )  # fmt: skip
    payload = server.received[-1]
    assert payload["model"] == "served-model"  # found at /v1/models
    assert payload["max_tokens"] == 3
    assert (payload["temperature"], payload["top_p"], payload["top_k"]) == (0.7, 0.9, 5)
    assert payload["ignore_eos"] is True
    assert payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True}


def test_chat_ttft_waits_for_content_not_the_role_chunk(serve) -> None:
    server = serve(ttft_s=0.1, itl_s=0.02)
    rec = bench(server.url, *SHORT, "--num-prompts", "2", "--endpoint", "/v1/chat/completions")
    assert server.received[-1]["messages"][0]["role"] == "user"
    assert all(0.1 <= ttft <= 0.1 + SLACK for ttft in rec["ttfts"])
    assert rec["output_lens"] == [3, 3]
    assert rec["generated_texts"] == ["tok0 tok1 tok2 "] * 2
    assert rec["endpoint_type"] == "openai-chat"


def test_output_tokens_counted_from_text_without_usage(serve) -> None:
    server = serve(include_usage=False)
    rec = bench(
        server.url, "--random-input-len", "6", "--random-output-len", "4", "--num-prompts", "2"
    )
    assert rec["output_lens"] == [4, 4]  # "tok0 tok1 tok2 tok3 " through /tokenize


def test_prompt_tokens_come_from_the_servers_usage(serve) -> None:
    # As vllm bench serve counts them: a chat prompt with its template's tokens.
    server = serve(template_tokens=7)
    rec = bench(server.url, *SHORT, "--num-prompts", "2", "--endpoint", "/v1/chat/completions",
                "--backend", "openai-chat")  # fmt: skip
    sent = [p["messages"][0]["content"] for p in server.received[1:]]
    assert rec["input_lens"] == [len(text.split()) + 7 for text in sent]
    assert rec["total_input_tokens"] == sum(rec["input_lens"])


def whitespace_tokenizer(folder: Path) -> Path:
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(10)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_local_tokenizer_counts_prompts_and_outputs(serve, tmp_path: Path) -> None:
    server = serve(serve_tokenize=False, include_usage=False)
    folder = whitespace_tokenizer(tmp_path / "tok")
    rec = bench(server.url, *SHORT, "--num-prompts", "3", "--tokenizer", str(folder))
    assert rec["input_lens"] == [len(p["prompt"].split()) for p in server.received[1:]]
    assert rec["output_lens"] == [3, 3, 3]
    assert rec["tokenizer_id"] == str(folder)


def test_requests_leave_at_their_arrival_times(serve) -> None:
    server = serve(ttft_s=0.01, itl_s=0.0)
    args = ("--num-prompts", "8", "--request-rate", "20", "--burstiness", "0.5", "--seed", "4")
    rec = bench(server.url, "--random-input-len", "4", "--random-output-len", "1", *args)
    expected = send_offsets(8, 20.0, 0.5, seed=4)
    assert all(e <= t <= e + SLACK for e, t in zip(expected, rec["start_times"], strict=True))
    assert rec["request_rate"] == 20.0 and rec["burstiness"] == 0.5


def test_max_concurrency_bounds_requests_in_flight(serve) -> None:
    server = serve(ttft_s=0.05, itl_s=0.01)
    rec = bench(server.url, *SHORT, "--num-prompts", "6", "--max-concurrency", "2")
    assert server.max_in_flight == 2
    assert rec["duration"] >= 3 * (0.05 + 2 * 0.01)  # three waves of two


def test_warmups_are_sent_but_not_measured(serve) -> None:
    server = serve(ttft_s=0.01, itl_s=0.0)
    rec = bench(server.url, *SHORT, "--num-prompts", "2", "--num-warmups", "3")
    assert len(server.received) == 1 + 3 + 2  # probe, warm-ups, measured
    assert rec["completed"] == 2
    # Every warm-up repeats the first request: none puts a later measured prompt in a cache.
    warmups = {str(w["prompt"]) for w in server.received[1:4]}
    measured = [str(m["prompt"]) for m in server.received[4:]]
    assert len(warmups) == 1 and warmups <= set(measured) and len(set(measured)) == 2


def test_max_duration_ends_the_run(serve) -> None:
    server = serve(ttft_s=0.2, itl_s=0.05)
    args = ("--num-prompts", "5", "--max-concurrency", "1", "--max-duration", "0.65")
    rec = bench(server.url, "--random-input-len", "4", "--random-output-len", "5", *args)
    # One request takes 400 ms: the first finishes (with 250 ms to spare on a busy machine),
    # the second is cut, three never leave.
    assert (rec["completed"], rec["failed"]) == (1, 0)
    assert (rec["aborted_requests"], rec["unsent_requests"]) == (1, 3)
    assert 0.65 <= rec["duration"] <= 0.65 + SLACK
    assert len(server.received) == 1 + 2
