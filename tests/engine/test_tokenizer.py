"""Chat template rendering and incremental detokenization that never splits a character."""

from __future__ import annotations

import pytest

from engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Über naïve café — 日本語 テキスト 😀 emoji! The quick brown fox."


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer(tiny_llama)


def test_streamed_deltas_join_to_the_full_text(tokenizer) -> None:
    prompt = tokenizer.encode("Prefill processes")
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push([token]) for token in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_across_tokens_waits_for_its_last_byte(tokenizer) -> None:
    # A byte-level tokenizer spells characters it has not merged byte by byte.
    ids = tokenizer.encode("😀")
    assert len(ids) > 1, "the emoji must span several tokens for this test"
    detok = IncrementalDetokenizer(tokenizer, [])
    partial = [detok.push([token]) for token in ids[:-1]]
    assert partial == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"


def test_chat_template_is_rendered_like_transformers(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    expected = tokenizer.hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert tokenizer.encode_chat(messages) == list(expected)
    assert tokenizer.render_chat(messages).endswith("<|im_start|>assistant\n")
