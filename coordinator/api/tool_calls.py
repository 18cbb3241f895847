"""Tool calls parsed out of a chat reply's text (`--tool-call-parser`), for `tool_choice: "auto"`.

Hermes-style models (Qwen2.5 and later, Hermes, many fine-tunes) write each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in their reply. The parser splits a
reply into its plain text and its calls. Streaming, it passes text on as it comes, holding back
only what may be the start of a tag, and keeps each call until its closing tag (a call's
arguments are sent whole, in one delta, as soon as the call is complete). A block that is not a
JSON object with a name stays text: nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends them


@dataclass
class HermesParser:
    """One reply's parser; `feed` each new piece of text, then `finish` once."""

    calls: list[ParsedCall] = field(default_factory=list)
    _held: str = ""  # text not yet passed on: a possible tag start, or an open call's body
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The text to pass on now, and the calls completed by this piece."""
        self._held += text
        out: list[str] = []
        done: list[ParsedCall] = []
        while True:
            if self._in_call:
                end = self._held.find(END)
                if end < 0:
                    return "".join(out), done
                body, self._held = self._held[:end], self._held[end + len(END) :]
                self._in_call = False
                call = _parse(body)
                if call is None:  # not a call after all: its text stays text
                    out.append(START + body + END)
                else:
                    done.append(call)
                    self.calls.append(call)
                continue
            start = self._held.find(START)
            if start >= 0:
                out.append(self._held[:start])
                self._held = self._held[start + len(START) :]
                self._in_call = True
                continue
            keep = _partial_tag(self._held)
            out.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return "".join(out), done

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What is left: a call the model did not close (it stopped at its end-of-turn token
        instead) still counts when it parses."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        self._in_call = False
        call = _parse(held)
        if call is None:
            return START + held, []
        self.calls.append(call)
        return "", [call]


def split_reply(text: str) -> tuple[str, list[ParsedCall]]:
    """A whole reply's text (calls taken out) and its calls."""
    parser = HermesParser()
    head, calls = parser.feed(text)
    tail, last = parser.finish()
    return head + tail, calls + last


def _parse(body: str) -> ParsedCall | None:
    """The call the model wrote, or None for text that is not one: not JSON (nested past the
    parser's depth, NaN or an infinite number included: their JSON back would not be JSON), not
    a named call, or holding a lone surrogate (a `\\ud800` escape), which no response can
    carry."""
    try:
        call = json.loads(body, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    try:
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        (call["name"] + arguments).encode("utf-8")
    except (RecursionError, UnicodeEncodeError):
        return None
    return ParsedCall(new_call_id(), call["name"], arguments)


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that begins START."""
    for size in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-size:]):
            return size
    return 0
