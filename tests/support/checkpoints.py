"""Tiny random-weight checkpoints built offline: the byte-level BPE tokenizer `tandem make-model`
writes (engine/random_model.py) and a Llama / Qwen2 / Qwen3 / Mistral model saved the way
Hugging Face saves them."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from engine.random_model import train_tokenizer

CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def build_checkpoint(
    folder: Path,
    family: str = "llama",
    num_layers: int = 2,
    seed: int = 0,
    **overrides: object,
) -> Path:
    """Writes config, tokenizer and random bf16-castable weights; returns `folder`."""
    tokenizer = train_tokenizer()
    options = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Larger than the default 0.02 so next-token distributions are peaked and greedy choices
        # have clear margins; much larger makes attention so sharp that rounding noise decides.
        initializer_range=0.1,
        tie_word_embeddings=family != "llama",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if family == "qwen3":
        options["head_dim"] = 32
    options.update(overrides)
    config = CONFIGS[family](**options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
