"""Model folders with seeded random weights, built from a known architecture's shape: what every
GPU test and benchmark runs on a machine that can download nothing (`tandem make-model`).

A folder holds what a downloaded checkpoint holds: config.json, safetensors (sharded past
SHARD_BYTES, with the index Hugging Face writes), and a tokenizer. The tokenizer is a byte-level
BPE trained in memory on a short built-in text, its vocabulary filled up to the architecture's
with tokens that decode to " w<id>", so that every id a random model picks decodes to text.

Tensor names and shapes come from transformers' own class for the architecture, built on the
meta device (no memory), so the folder loads in transformers as it does here. Every tensor is
drawn on the CPU from its own generator (seed + index): the same seed gives the same bytes on
any machine and at any sharding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when a folder is written: `tandem --help` must not load it
    import torch

# The shapes of published checkpoints (their config.json), without their weights.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip


@dataclass(frozen=True)
class Architecture:
    model_type: str  # transformers' name: llama, qwen2, qwen3
    dims: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {
    "smollm2-135m": Architecture("llama", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
        rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    "qwen2.5-0.5b": Architecture("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)),
    "qwen3-0.6b": Architecture("qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)),
    "llama-3.2-1b": Architecture("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
        {"rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}}),
    "llama-3.1-8b": Architecture("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
        {"rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}}),
}  # fmt: skip

SHARD_BYTES = 4 << 30  # Hugging Face's 5 GB shards, rounded down
INIT_STD = 0.02  # every published config's initializer_range
INDEX_FILE = "model.safetensors.index.json"

# ---- the tokenizer ---------------------------------------------------------------------------

CHATML = (  # tools and tool calls as Hermes-style templates write them
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function'] | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefill processes the prompt; decode generates one token at a time.",
    "Über naïve café — ünïcödé 日本語 テキスト 😀 emoji!",
    "0123456789 + - * / = ( ) [ ] { } < > ? ! . , ; :",
] * 20
TRAINED_VOCAB = 384  # BPE merges learned from CORPUS; the rest of a vocabulary is filler


def train_tokenizer(vocab_size: int = TRAINED_VOCAB, filled_to: int | None = None):
    """A byte-level BPE tokenizer (a transformers PreTrainedTokenizerFast) of `vocab_size`
    learned tokens, with filler tokens up to `filled_to` ids when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if filled_to is not None and filled_to > tok.get_vocab_size():
        tok = _filled(tok, filled_to)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


def _filled(tok, size: int):
    """`tok` with plain vocabulary entries "Ġw<id>" (" w<id>" decoded; "Ġ" is the byte-level
    alphabet's space) for every id it lacks below `size`. No merge makes them, so encoding is
    unchanged; they exist so that any id decodes to text."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in spec["added_tokens"]}
    for i in range(size):
        if i not in taken:
            vocab[f"\u0120w{i}"] = i
    return Tokenizer.from_str(json.dumps(spec))


# ---- the weights -----------------------------------------------------------------------------


def hf_config(arch: Architecture, tokenizer, num_layers: int | None = None):
    from transformers import AutoConfig

    dims = dict(arch.dims)
    if num_layers is not None:
        dims["num_hidden_layers"] = num_layers
    return AutoConfig.for_model(
        arch.model_type,
        **dims,
        **arch.extra,
        initializer_range=INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16",
    )


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as transformers names them (tied weights once). Sets
    `config.architectures`, the class loaders look for."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm scales 1, biases and matrices drawn at INIT_STD (biases too: Qwen2's q/k/v biases
    are large in trained checkpoints, and zeros would leave their add untested)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    values = torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=generator)
    return values.to(torch.bfloat16)


def write_weights(shapes: dict[str, tuple[int, ...]], dest: Path, seed: int) -> int:
    """Writes safetensors shards of at most SHARD_BYTES (one file when it fits, else shards and
    their index); returns the bytes written."""
    import torch
    from safetensors.torch import save_file

    groups: list[list[str]] = [[]]
    sizes = [0]
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if groups[-1] and sizes[-1] + nbytes > SHARD_BYTES:
            groups.append([])
            sizes.append(0)
        groups[-1].append(name)
        sizes[-1] += nbytes
    order = {name: i for i, name in enumerate(shapes)}
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    for file, names in zip(files, groups, strict=True):
        tensors = {
            n: random_tensor(n, shapes[n], torch.Generator().manual_seed(seed + order[n]))
            for n in names
        }
        save_file(tensors, str(dest / file), metadata={"format": "pt"})
    if len(files) > 1:
        weight_map = {n: f for f, names in zip(files, groups, strict=True) for n in names}
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (dest / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return sum(sizes)


def make_model(arch_name: str, dest: Path, seed: int = 0, num_layers: int | None = None) -> int:
    """Writes `arch_name`'s folder into `dest` (created; must be empty or absent); returns the
    weight bytes written."""
    if arch_name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch_name!r}; known: {', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[arch_name]
    most = arch.dims["num_hidden_layers"]
    if num_layers is not None and not 1 <= num_layers <= most:  # (a million: terabytes)
        raise ValueError(f"num_layers must be in [1, {most}] ({arch_name}'s layers)")
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty")
    tokenizer = train_tokenizer(filled_to=arch.dims["vocab_size"])
    config = hf_config(arch, tokenizer, num_layers)
    written = write_weights(tensor_shapes(config), dest, seed)
    config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return written
