"""transformers as the reference implementation: what its greedy decoding gives."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(folder: Path, prompt_ids: list[int], n: int) -> list[int]:
    """Exactly `n` greedy tokens after `prompt_ids` (EOS masked), float32 on CPU."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, len(prompt_ids) :].tolist()
