"""Tiny random-weight checkpoints built offline: a byte-level BPE tokenizer trained in memory and
a Llama / Qwen2 / Qwen3 / Mistral model saved the way Hugging Face saves them."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

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

CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def train_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
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
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


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
