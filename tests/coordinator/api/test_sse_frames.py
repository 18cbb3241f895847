"""TextFrames must write exactly what pydantic writes for the same chunk."""

import pytest

from coordinator.api.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
)
from coordinator.api.sse import TextFrames, frame

TEXTS = [
    "",
    " hello",
    'say "hi" \\ back/slash',
    "".join(chr(c) for c in range(0x20)),  # every control character
    "\x7f é ß 漢字 \u2028 \u2029 \ufeff",
    "\U0001f600 emoji and \U0010ffff",
    "tandem-text-goes-here",  # the marker itself, as text
    "".join(chr(c) for c in range(0x20, 0x800)),
]


def completion(index: int, text: str) -> Completion:
    choice = CompletionChoice(index=index, text=text)
    return Completion(id="cmpl-abc", created=1764200000, model="m/x", choices=[choice])


def chat(index: int, text: str) -> ChatCompletionChunk:
    choice = ChatChunkChoice(index=index, delta=Delta(content=text))
    return ChatCompletionChunk(id="chatcmpl-abc", created=1764200000, model="m", choices=[choice])


@pytest.mark.parametrize("model", [completion, chat])
@pytest.mark.parametrize("text", TEXTS)
def test_a_text_frame_is_the_models_own_frame(model, text: str) -> None:
    frames = TextFrames(model)
    assert frames.frame(3, text) == frame(model(3, text))


def test_a_lone_surrogate_is_left_to_pydantic() -> None:
    frames = TextFrames(completion)
    try:
        expected = frame(completion(0, "a\ud800b"))
    except Exception as err:  # pydantic refuses it: so must the fast path
        with pytest.raises(type(err)):
            frames.frame(0, "a\ud800b")
    else:
        assert frames.frame(0, "a\ud800b") == expected


def test_a_template_must_carry_the_text() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        TextFrames(lambda i, t: completion(i, "fixed")).frame(0, "x")
