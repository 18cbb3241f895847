"""Ticket: a decode worker's answer to "where does this request's KV go?" (plain data)."""

from __future__ import annotations

from typing import NamedTuple

from kvtransfer.transport import Endpoint


class KVLayout(NamedTuple):
    """Shape of the KV both sides hold; a prefill worker refuses a ticket that differs."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def bytes_per_token_layer(self) -> int:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return 2 * self.kv_heads * self.head_dim * itemsize

    def bytes_for(self, num_tokens: int) -> int:
        return num_tokens * self.num_layers * self.bytes_per_token_layer()


class Ticket(NamedTuple):
    request_id: str
    decode_id: str
    rendezvous: Endpoint
    channel_key: str  # names the (prefill, decode) channel, new after a channel breaks
    num_cached_tokens: int  # leading tokens the decode worker already holds: not sent
    num_tokens: int  # tokens whose KV the decode worker needs in total
    layout: KVLayout
    timeout: float  # seconds the decode worker holds the reservation (a lease)

    @property
    def num_bytes(self) -> int:
        return self.layout.bytes_for(self.num_tokens - self.num_cached_tokens)
