"""Chat template rendering and incremental detokenization that never splits a character."""

from __future__ import annotations

import random

import pytest

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

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


@pytest.mark.parametrize("window", ["rust", "python"])
def test_a_character_cut_by_the_last_token_is_left_out(tokenizer, monkeypatch, window) -> None:
    """max_tokens ended the output inside a character: its bytes are no text (vLLM leaves them
    out too); the whole characters before them are kept."""
    if window == "python":
        monkeypatch.setattr(Tokenizer, "decode_stream", lambda self, ids, skip: None)
    ids = tokenizer.encode("é😀")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.push([token]) for token in ids[:cut]) + detok.flush()
    assert text == "é"


def test_chat_template_is_rendered_like_transformers(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    expected = tokenizer.hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert tokenizer.encode_chat(messages) == list(expected)
    assert tokenizer.render_chat(messages).endswith("<|im_start|>assistant\n")


def test_a_developer_message_is_a_system_message_to_a_template_that_does_not_name_it(
    tokenizer, monkeypatch
) -> None:
    """OpenAI's "developer" is the system role's newer name; rendered as it came, a template
    that only knows "system" wrote its own default system prompt and then a "developer" turn."""
    developer = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "hi"},
    ]
    system = [{**developer[0], "role": "system"}, developer[1]]
    assert "developer" not in tokenizer.hf.chat_template
    assert tokenizer.render_chat(developer) == tokenizer.render_chat(system)
    knows = tokenizer.hf.chat_template + "{# renders developer turns as they come #}"
    aware = Tokenizer.__new__(Tokenizer)
    aware.__dict__.update(tokenizer.__dict__)
    aware.__dict__.pop("_template_knows_developer", None)
    monkeypatch.setattr(tokenizer.hf, "chat_template", knows)
    assert aware._template_knows_developer  # a template that names it gets it as sent
    assert "developer" in aware.render_chat(developer)


def _deltas(tokenizer, prompt, ids, groups, python_window: bool, monkeypatch) -> list[str]:
    with monkeypatch.context() as patch:
        if python_window:
            patch.setattr(tokenizer, "decode_stream", lambda *args: None)
        detok = IncrementalDetokenizer(tokenizer, prompt)
    assert (detok.stream is None) == python_window
    deltas, at = [], 0
    for size in groups:
        deltas.append(detok.push(ids[at : at + size]))
        at += size
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rust_and_python_windows_give_the_same_text(tokenizer, monkeypatch, seed) -> None:
    # Random ids (byte tokens cut characters anywhere, special tokens decode to nothing), ending
    # inside a character, which flush leaves out. Pushed one at a time, both windows give
    # the same deltas; pushed in groups, the Rust one may give a group's whole characters before
    # the cut one (Python holds the group back), and the text joins up the same.
    rng = random.Random(seed)
    vocab = len(tokenizer.hf)
    ids = tokenizer.encode(TEXT) + [rng.randrange(vocab) for _ in range(300)]
    ids += tokenizer.encode("😀")[:-1]
    groups, left = [], len(ids)
    while left:
        groups.append(min(left, rng.choice([1, 1, 1, 2, 3])))
        left -= groups[-1]
    prompt = tokenizer.encode("Prefill processes")
    # The cut emoji's bytes are left out at the end (the full decode has them as U+FFFD).
    full = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :].rstrip("\ufffd")
    ones = [1] * len(ids)
    rust = _deltas(tokenizer, prompt, ids, ones, python_window=False, monkeypatch=monkeypatch)
    python = _deltas(tokenizer, prompt, ids, ones, python_window=True, monkeypatch=monkeypatch)
    assert rust == python
    assert "".join(rust) == full
    assert tokenizer.decode(prompt + ids).endswith("\ufffd") and not rust[-1].endswith("\ufffd")
    for python_window in (False, True):
        grouped = _deltas(tokenizer, prompt, ids, groups, python_window, monkeypatch)
        assert "".join(grouped) == full


def test_a_folder_without_a_usable_tokenizer_is_named(tiny_llama, tmp_path) -> None:
    """transformers' own message ran to five lines about sentencepiece and tiktoken, and a
    corrupt tokenizer.json gave a JSONDecodeError with no path."""
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text((tiny_llama / "config.json").read_text())
    with pytest.raises(TokenizerError, match=f"cannot load the tokenizer in {tmp_path / 'none'}"):
        Tokenizer(tmp_path / "none")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        if (tiny_llama / name).exists():
            (corrupt / name).write_text((tiny_llama / name).read_text())
    (corrupt / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=f"cannot load the tokenizer in {corrupt}"):
        Tokenizer(corrupt)
