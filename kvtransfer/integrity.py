"""KV checksums: what the prefill side packed is what the decode side unpacks, or the attempt
fails before a single token is decoded from it.

Each payload (one layer of one request chunk) gets a checksum where it is packed and again where
it is unpacked: the 64-bit sum of its bytes read as int32 words. One flipped bit changes a word
by a power of two, so it always changes the sum (no int64 overflow below 2**32 words); a lost or
truncated payload fails the byte count first. It is one read of the payload, a plain reduction
that runs where the payload lives (on a GPU: on the GPU). It does not catch two words swapped.

A request's payload sums fold into one digest in send order (layer by layer, chunks in order
within a layer, step by step), which travels in its done frame; the receiver folds the same way.
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
