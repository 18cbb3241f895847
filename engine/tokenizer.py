"""The checkpoint's tokenizer and chat template, and incremental detokenization for streaming."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers loads torch: only a Tokenizer's construction pays for it
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.decoders import DecodeStream
    from transformers import PreTrainedTokenizerBase

# Tokens of the prompt decoded along with the first output tokens, so that tokenizers which
# drop a word's leading space at the start of a decode still produce it.
PROMPT_CONTEXT_TOKENS = 5
# apply_chat_template's own arguments: a request's template options may not set them ("self"
# included: a keyword of that name reaches the bound method twice). `render_chat` also refuses
# any other named argument the installed transformers' apply_chat_template has.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"self", "conversation", "chat_template", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
     "continue_final_message", "documents", "sanitize_control_tokens"}
)  # fmt: skip


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

        try:
            self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as err:  # no tokenizer files, or files that do not parse
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TokenizerError(f"cannot load the tokenizer in {path}: {first}") from None
        # The Rust tokenizer underneath a fast one (None for a slow, pure-Python tokenizer).
        self.backend: RustTokenizer | None = getattr(self.hf, "_tokenizer", None)
        # Whether the Rust incremental decoder gives `decode`'s text (see decode_stream).
        self._streams = self.backend is not None and not self._cleans_up_spaces()

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_unicode(text)
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as the model's chat template writes it. `tools` (function schemas)
        and `template_kwargs` are variables the template may read."""
        if not self.has_chat_template:
            raise TokenizerError("this model has no chat template")
        for message in messages:
            content = message.get("content")
            for part in content if isinstance(content, list) else [content]:
                if isinstance(part, str):
                    check_unicode(part)
        reserved = (RESERVED_TEMPLATE_KWARGS | self._template_arguments).intersection(
            template_kwargs
        )
        if reserved:
            raise TokenizerError(f"chat template options may not set {', '.join(sorted(reserved))}")
        if not self._template_knows_developer:
            # OpenAI's "developer" is the system role's newer name; a template that does not
            # name it would render it as an unknown turn (SmolLM2's: its own default system
            # prompt, then a "developer" turn).
            messages = [
                {**m, "role": "system"} if m.get("role") == "developer" else m for m in messages
            ]
        try:
            return self.hf.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )
        except Exception as err:  # the template itself raises on messages it rejects
            raise TokenizerError(f"chat template rejected the messages: {err}") from err

    @functools.cached_property
    def _template_knows_developer(self) -> bool:
        template = self.hf.chat_template
        texts = template.values() if isinstance(template, dict) else [template or ""]
        return any("developer" in text for text in texts)

    @functools.cached_property
    def _template_arguments(self) -> frozenset[str]:
        """The named arguments of apply_chat_template besides the messages, tools and the
        generation prompt, which the template's variables must not shadow."""
        parameters = inspect.signature(self.hf.apply_chat_template).parameters.values()
        named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        return frozenset(named - {"tools", "add_generation_prompt"})

    def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """`options`: `render_chat`'s."""
        # The rendered template already holds BOS and friends: add no special tokens again.
        return self.encode(self.render_chat(messages, **options), add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # `decode` first walks the ids through transformers' generic to-Python conversion, a
        # tenth of a streaming server's time; ours are a list of ints already, so go one level
        # down (same text: `decode` ends in `_decode`).
        fast = getattr(self.hf, "_decode", None)
        if fast is None:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return fast(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context: list[int], skip_special_tokens: bool) -> DecodeStream | None:
        """A Rust incremental decoder primed with `context`, where it gives the same text as
        `decode`: None when transformers post-processes the decoded text (its clean-up of
        spaces before punctuation), or the tokenizer is not a `tokenizers` one."""
        if not self._streams:
            return None
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def _cleans_up_spaces(self) -> bool:
        if not getattr(self.hf, "clean_up_tokenization_spaces", False):
            return False
        # transformers skips the clean-up for BPE models unless forced (it corrupts them).
        forced = getattr(
            self.hf,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False,
        )
        return type(self.backend.model).__name__ != "BPE" or forced


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are always whole characters.

    The text a token adds is what decoding a small window of recent tokens with it adds to
    decoding the window without it; a byte-level token that ends inside a multi-byte character
    decodes to U+FFFD, so such text waits for the next token. The window starts with the
    prompt's last tokens, so tokenizers that drop a word's leading space at the start of a
    decode still produce it.

    Where the checkpoint's tokenizer is a `tokenizers` one whose decode transformers does not
    post-process, the window lives in Rust (`tokenizers.decoders.DecodeStream`: one call per
    token instead of two decodes and two list slices in Python); otherwise in Python, the same
    way.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.stream = tokenizer.decode_stream(context, skip_special_tokens)
        # Python window: [prefix_offset, read_offset) of `ids` is text already emitted.
        # Rust window: `ids` holds the tokens that produced the last text (the context at
        # first), then from `read_offset` those still waiting for their character's last byte:
        # what `flush` has left to decode.
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Text completed by these tokens (possibly empty while a character is incomplete)."""
        if self.stream is None:
            self.ids.extend(token_ids)
            return self._advance(final=False)
        pieces = []
        for token in token_ids:
            piece = self.stream.step(self.tokenizer.backend, token)
            if piece is None:
                self.ids.append(token)
            else:
                pieces.append(piece)
                self.ids = [*self.ids[self.read_offset :], token]
                self.read_offset = len(self.ids)
        return "".join(pieces)

    def flush(self) -> str:
        """Whatever text is still held back, once no more tokens will come, less the bytes of
        a character the tokens stopped inside (max_tokens cut it): those decode to U+FFFD,
        which is no text the model wrote."""
        return self._advance(final=True).rstrip("\ufffd")

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(self.ids[self.prefix_offset : self.read_offset], skip)
        after = decode(self.ids[self.prefix_offset :], skip)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]
