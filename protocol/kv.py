"""Where a request's KV goes and what shape it has: a decode worker's Ticket, as plain data."""

from __future__ import annotations

from typing import NamedTuple

# The one table of model dtypes: their names (config files, flags, KV layouts) and sizes. Torch's
# dtype of the same name is `getattr(torch, name)`.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class Endpoint(NamedTuple):
    host: str
    port: int


class KVLayout(NamedTuple):
    """Shape of the KV both sides hold; a prefill worker refuses a ticket that differs."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

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
    verify: bool = True  # the prefill side sends a digest of the KV; the decode side checks it

    @property
    def num_bytes(self) -> int:
        return self.layout.bytes_for(self.num_tokens - self.num_cached_tokens)
