"""Where a request's KV goes and what shape it has: a decode worker's Ticket, as plain data.

Under tensor parallelism each rank holds a range of the model's KV heads, on both sides. A
transfer is then a set of routes, one per (prefill rank, decode rank) pair that shares heads:
each prefill rank sends the heads it owns straight to the decode ranks that hold them, and a
head several prefill ranks replicate is sent by one of them only.

    4 KV heads, prefill TP 2 -> decode TP 1:   route 0>0 heads 0-1, route 1>0 heads 2-3
    4 KV heads, prefill TP 1 -> decode TP 2:   route 0>0 heads 0-1, route 0>1 heads 2-3
    2 KV heads, prefill TP 4 -> decode TP 2:   route 0>0 head 0,    route 2>1 head 1

Each route has its own channel; route 0>0 is always there and carries the sampled token.
"""

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


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> range:
    """The model's KV heads that rank `rank` of `size` holds. With fewer KV heads than ranks,
    each head is replicated on `size // num_kv_heads` consecutive ranks."""
    if num_kv_heads >= size:
        per_rank = num_kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (size // num_kv_heads)
    return range(head, head + 1)


class Route(NamedTuple):
    """KV heads [head_start, head_stop) of the model, from prefill rank `src` to decode rank
    `dst`."""

    src: int
    dst: int
    head_start: int
    head_stop: int

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start


def kv_routes(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[Route]:
    """Every route of a transfer, by decode rank, then head. Each decode rank gets each of its
    heads exactly once; among the prefill ranks replicating a head, the decode ranks
    replicating it are spread over them in order (equal layouts pair rank i with rank i)."""
    owners: dict[int, list[int]] = {}
    for rank in range(prefill_tp):
        for head in kv_head_range(num_kv_heads, prefill_tp, rank):
            owners.setdefault(head, []).append(rank)
    holders: dict[int, list[int]] = {}
    for rank in range(decode_tp):
        for head in kv_head_range(num_kv_heads, decode_tp, rank):
            holders.setdefault(head, []).append(rank)
    routes: list[Route] = []
    for dst in range(decode_tp):
        for head in kv_head_range(num_kv_heads, decode_tp, dst):
            sources = owners[head]
            src = sources[holders[head].index(dst) % len(sources)]
            last = routes[-1] if routes else None
            if last is not None and (last.src, last.dst, last.head_stop) == (src, dst, head):
                routes[-1] = last._replace(head_stop=head + 1)
            else:
                routes.append(Route(src, dst, head, head + 1))
    return routes


def route_key(channel_key: str, route: Route) -> str:
    """The channel of one route: the pair's own key for route 0>0, a derived one otherwise."""
    if (route.src, route.dst) == (0, 0):
        return channel_key
    return f"{channel_key}|{route.src}>{route.dst}"


def base_key(key: str) -> str:
    """The pair's channel key that a route's key derives from."""
    return key.split("|", 1)[0]


def key_generation(key: str) -> tuple[str, int] | None:
    """(the receiver that made the key, its number there), None for a key without one. One
    receiver hands out its keys in number order, a new one each time the last broke; keys of
    two receivers (a decode worker that left and came back) have no order."""
    receiver, sep, number = base_key(key).rpartition("#")
    return (receiver, int(number)) if sep and number.isdigit() else None


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
    prefill_tp: int = 1  # ranks of the prefill worker, and of the decode worker: their
    decode_tp: int = 1  # routes are kv_routes(layout.kv_heads, prefill_tp, decode_tp)

    @property
    def routes(self) -> list[Route]:
        return kv_routes(self.layout.kv_heads, self.prefill_tp, self.decode_tp)

    def legs(self, src: int) -> list[tuple[Ticket, Route]]:
        """The routes prefill rank `src` sends, each with the ticket naming its channel."""
        return [
            (self._replace(channel_key=route_key(self.channel_key, route)), route)
            for route in self.routes
            if route.src == src
        ]

    def legs_into(self, dst: int) -> list[tuple[str, Route]]:
        """The routes decode rank `dst` receives, each with its channel key."""
        return [
            (route_key(self.channel_key, route), route) for route in self.routes if route.dst == dst
        ]

    @classmethod
    def from_wire(cls, fields: list) -> Ticket:
        """A ticket sent as plain lists (msgpack), rebuilt."""
        ticket = cls(*fields)
        return ticket._replace(
            rendezvous=Endpoint(*ticket.rendezvous), layout=KVLayout(*ticket.layout)
        )

    @property
    def num_bytes(self) -> int:
        return self.layout.bytes_for(self.num_tokens - self.num_cached_tokens)
