"""Synthetic prompt text of a requested token length, for any tokenizer. Token counts are not
exactly additive across word boundaries, so the fit is iterative and bounded, and the count
returned is always the measured one."""

from __future__ import annotations

import numpy as np

from loadtest.token_count import TokenCounter

MAX_FIT_ROUNDS = 6
COMMON_WORDS = """
time person year way day thing man world life hand part child eye woman place work week case point
company number group problem fact water room mother area money story month lot right study book
job word business issue side kind head house service friend father power hour game line end member
law car city community name president team minute idea kid body information back parent face others
level office door health art war history party result change morning reason research girl guy moment
air teacher force education river garden
"""
WORDS = tuple(COMMON_WORDS.split())


def synthesize_text(
    num_tokens: int, rng: np.random.Generator, counter: TokenCounter
) -> tuple[str, int]:
    """Random words fitted to about `num_tokens` tokens; returns the text and its token count."""
    pool = [str(word) for word in rng.choice(WORDS, size=2 * num_tokens + 8)]

    def measure(num_words: int) -> tuple[str, int]:
        text = " ".join(pool[:num_words])
        return text, counter.count(text)

    num_words = min(num_tokens, len(pool))
    text, count = measure(num_words)
    best = (text, count)
    for _ in range(MAX_FIT_ROUNDS):
        if count == num_tokens:
            break
        proposal = round(num_words * num_tokens / max(count, 1))
        if proposal == num_words:
            proposal += 1 if count < num_tokens else -1
        if not 1 <= proposal <= len(pool):
            break
        num_words = proposal
        text, count = measure(num_words)
        if abs(count - num_tokens) < abs(best[1] - num_tokens):
            best = (text, count)
    return best
