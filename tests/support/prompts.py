"""Prompt sets shared by the engine, transfer and disaggregation tests."""

from __future__ import annotations

import random


def mixed_prompts(vocab: int, count: int = 16, seed: int = 7) -> list[list[int]]:
    """`count` prompts of 1 to 60 random token ids in [3, vocab): the same ones for a seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(count)]
