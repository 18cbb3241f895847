"""The checkpoint's tokenizer and chat template, and incremental detokenization for streaming."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers loads torch: only a Tokenizer's construction pays for it
    from transformers import PreTrainedTokenizerBase

# Tokens of the prompt decoded along with the first output tokens, so that tokenizers which
# drop a word's leading space at the start of a decode still produce it.
PROMPT_CONTEXT_TOKENS = 5


class TokenizerError(ValueError):
    """Input the tokenizer cannot handle (for example, chat messages with no chat template)."""


def check_unicode(text: str) -> None:
    """Raises TokenizerError for text that cannot be UTF-8 (a lone surrogate, as JSON's
    "\\ud800" escapes allow): tokenizers take only valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise TokenizerError(
            f"the text is not valid Unicode: a lone surrogate at character {err.start}"
        ) from None


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_unicode(text)
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not self.has_chat_template:
            raise TokenizerError("this model has no chat template")
        for message in messages:
            content = message.get("content")
            for part in content if isinstance(content, list) else [content]:
                if isinstance(part, str):
                    check_unicode(part)
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # the template itself raises on messages it rejects
            raise TokenizerError(f"chat template rejected the messages: {err}") from err

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The rendered template already holds BOS and friends: add no special tokens again.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # `decode` first walks the ids through transformers' generic to-Python conversion, a
        # tenth of a streaming server's time; ours are a list of ints already, so go one level
        # down (same text: `decode` ends in `_decode`).
        fast = getattr(self.hf, "_decode", None)
        if fast is None:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return fast(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are always whole characters.

    Keeps a small window [prefix_offset, read_offset) of already-emitted tokens and decodes it
    with the new ones; the new text is what the longer decode adds. A byte-level token that ends
    inside a multi-byte character decodes to U+FFFD, so such text waits for the next token.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Text completed by these tokens (possibly empty while a character is incomplete)."""
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever text is still held back, once no more tokens will come."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(self.ids[self.prefix_offset : self.read_offset], skip)
        after = decode(self.ids[self.prefix_offset :], skip)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]
