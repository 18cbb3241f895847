"""Token-level stop rules, checked after each sampled token. Stop strings are the frontend's."""

from __future__ import annotations

from collections.abc import Collection

from engine.sequence import Sequence
from protocol.sampling import FinishReason


def blocked_tokens(seq: Sequence, eos_ids: Collection[int]) -> tuple[int, ...]:
    """Tokens the sampler must not pick yet: every stopping token while under min_tokens."""
    params = seq.params
    if seq.num_output_tokens >= params.min_tokens:
        return ()
    return tuple(sorted(params.stop_ids(eos_ids)))


def check_stop(
    seq: Sequence, eos_ids: Collection[int], max_model_len: int
) -> tuple[FinishReason, int | None] | None:
    """After a token was appended: (finish reason, stopping token id) or None to go on."""
    params, last = seq.params, seq.token_ids[-1]
    if params.stops_at(last, eos_ids) and seq.num_output_tokens >= params.min_tokens:
        return FinishReason.STOP, last
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None
