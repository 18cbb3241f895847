"""KV checksums: what the prefill side packed is what the decode side unpacks, or the attempt
fails before a single token is decoded from it.

Each part of a payload (one layer of one request chunk; a payload carries a step's chunks on one
channel back to back) gets a checksum where it is packed and again where it is unpacked: the
64-bit sum of its bytes read as int32 words. One flipped bit changes a word by a power of two,
so it always changes the sum (no int64 overflow below 2**32 words); a lost or truncated payload
fails the byte count first. It is one read of the payload for all its parts, a plain reduction
that runs where the payload lives (on a GPU: on the GPU). It does not catch two words swapped.

A request's part sums fold into one digest in send order (layer by layer, step by step), which
travels in its done frame; the receiver folds the same way.
"""

from __future__ import annotations

import torch

DIGEST_START = 0
_MULTIPLIER = 0x100000001B3  # the fold is order-sensitive: FNV's 64-bit prime
_MASK = (1 << 64) - 1


def payload_sum(payload: torch.Tensor) -> int:
    """The checksum of one payload (contiguous, any dtype)."""
    flat = payload.reshape(-1)
    raw = flat.view(torch.uint8)
    if raw.numel() % 4:
        return int(raw.sum(dtype=torch.int64))
    return int(raw.view(torch.int32).sum(dtype=torch.int64))


def fold(digest: int, payload_checksum: int) -> int:
    """The digest after one more payload's checksum."""
    return ((digest * _MULTIPLIER) ^ (payload_checksum & _MASK)) & _MASK


def part_sums(payload: torch.Tensor, sizes: list[int]) -> list[int]:
    """The checksums of a payload's parts: `payload` is [2, sum(sizes), ...], part i the
    `sizes[i]` tokens after the parts before it (in both halves). Each equals payload_sum of that
    part packed alone where a token's row is whole int32 words (every KV layout; otherwise the
    bytes are summed). One reduction and one read back, however many parts."""
    rows = payload.shape[1]
    raw = payload.reshape(2, rows, -1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.shape[2] % 4 == 0 else raw
    per_token = words.sum(dim=(0, 2), dtype=torch.int64)  # [rows]
    ends = torch.tensor(sizes, device=payload.device).cumsum(0)
    totals = torch.cat((per_token.new_zeros(1), per_token.cumsum(0)))[ends]
    starts = torch.cat((totals.new_zeros(1), totals[:-1]))
    return (totals - starts).tolist()
