"""The update stream's framing: how a decode worker pushes its token updates to the coordinator.

One TCP connection per decode worker, opened by the worker. Every frame is a 4-byte big-endian
length and a msgpack body:

    first frame     [HELLO, worker_id, secret]        the coordinator drops a connection whose
                                                      secret is not the one it handed out
    every frame     [[kind, *fields], ...]            one engine step's updates, in order

Updates travel as their NamedTuple fields (msgpack packs tuples as arrays); only the enum and
the nested logprobs need rebuilding on the way in.
"""

from __future__ import annotations

import struct

import msgpack

from protocol.messages import RequestFailed, TokenUpdate, WorkerUpdate
from protocol.sampling import FinishReason, PromptLogprob, TokenLogprobs

HELLO = "tandem-updates/1"
HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a larger length means a corrupt stream, not a big batch
_TOKENS, _FAILED = 0, 1


class FrameError(ValueError):
    """Bytes that are not a frame of this protocol."""


def frame(body: object) -> bytes:
    payload = msgpack.packb(body)
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length} bytes")
    return length


def hello(worker_id: str, secret: str) -> bytes:
    return frame([HELLO, worker_id, secret])


def read_hello(payload: bytes) -> tuple[str, str]:
    """(worker_id, secret) of a first frame."""
    body = _unpack(payload)
    if not (isinstance(body, list) and len(body) == 3 and body[0] == HELLO):
        raise FrameError("the first frame is not a hello")
    return str(body[1]), str(body[2])


def pack_updates(updates: list[WorkerUpdate]) -> bytes:
    return frame([_fields(update) for update in updates])


def update_frames(updates: list[WorkerUpdate], limit: int = MAX_FRAME_BYTES) -> list[bytes]:
    """`updates` in frames of at most `limit` bytes each (a batch too big goes in halves); one
    update too big for any frame (prompt logprobs past what admission allows) becomes its
    request's failure, never a frame the reader must take for a corrupt stream."""
    payload = pack_updates(updates)
    if len(payload) - HEADER.size <= limit:
        return [payload]
    if len(updates) > 1:
        half = len(updates) // 2
        return update_frames(updates[:half], limit) + update_frames(updates[half:], limit)
    reason = f"its update is {len(payload)} bytes, over the {limit}-byte frame limit"
    return [pack_updates([RequestFailed(updates[0].request_id, reason, False, invalid=True)])]


def unpack_updates(payload: bytes) -> list[WorkerUpdate]:
    body = _unpack(payload)
    try:
        return [_update(item) for item in body]
    except (TypeError, ValueError, IndexError) as err:
        raise FrameError(f"a malformed update: {err}") from None


def _fields(update: WorkerUpdate) -> list:
    if isinstance(update, RequestFailed):
        return [_FAILED, *update]
    finish = None if update.finish_reason is None else update.finish_reason.value
    return [_TOKENS, *update[:4], finish, *update[5:]]


def _update(item: list) -> WorkerUpdate:
    kind, *fields = item
    if kind == _FAILED:
        return RequestFailed(*fields)
    request_id, first_index, token_ids, logprobs, finish, *rest = fields
    update = TokenUpdate(
        request_id,
        first_index,
        token_ids,
        [None if lp is None else _logprobs(*lp) for lp in logprobs],
        None if finish is None else FinishReason(finish),
        *rest,
    )
    if update.prompt_logprobs is None:
        return update
    prompt = [None if lp is None else _prompt_logprob(*lp) for lp in update.prompt_logprobs]
    return update._replace(prompt_logprobs=prompt)


def _logprobs(logprob: float, top: list[list]) -> TokenLogprobs:
    return TokenLogprobs(logprob, [tuple(pair) for pair in top])


def _prompt_logprob(logprob: float, rank: int, top: list[list]) -> PromptLogprob:
    return PromptLogprob(logprob, rank, [tuple(pair) for pair in top])


def _unpack(payload: bytes) -> object:
    try:
        return msgpack.unpackb(payload)
    except Exception as err:  # msgpack raises several types for bad bytes
        raise FrameError(f"not msgpack: {type(err).__name__}") from None
