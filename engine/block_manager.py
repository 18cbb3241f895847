"""Block manager: which KV blocks are free, who holds them, and which hold a cached prefix.

Pure Python (no torch). A full block is identified by a chained hash

    hash(block i) = hash((hash(block i-1), *tokens of block i))

so equal hashes mean equal prefixes, barring a collision; every hit re-checks what the hash
stands for, so a collision (chance or crafted: Python's int hashing is public and unkeyed) is
a miss, never another prompt's KV. A cached block remembers where its tokens are (the token list
and an offset, not a copy) and the block it was computed after, with that block's generation
(bumped whenever a block leaves the cache): a hit at position i needs the block's own tokens,
position i, and as its parent the very block the walk matched at i - 1, still holding what it
held then. Block 0's parent is none, so by induction a hit holds exactly the prompt's prefix.
A sequence keeps the hashes of its blocks (`Sequence.block_hashes`, filled by `chain_hashes`),
so each block is hashed once however often its prefix is looked up or cached.

A block is in exactly one state:
    held       ref_count > 0, in some sequence's block table
    cached     ref_count == 0 with a hash: reusable as a prefix, evicted least recently used first
    free       ref_count == 0 without a hash
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

# The parent of a sequence's first block. Python hashes int tuples the same in every process
# (no per-process salt), which lets the router compare its prefix hashes with the ones workers
# report. Not None: before Python 3.12, hash(None) is the object's address, different in every
# process, so no hash computed in one process matched another's.
ROOT_HASH = 0


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """`parent`: the previous block's hash, None for a first block."""
    return hash((ROOT_HASH if parent is None else parent, *tokens))


def chain_hashes(
    token_ids: Sequence[int], block_size: int, hashes: list[int], count: int
) -> list[int]:
    """Extends `hashes`, the chained hashes of the first full blocks of `token_ids`, to `count`
    blocks (in place), and returns it."""
    first = len(hashes)
    if count <= first:
        return hashes
    parent = hashes[-1] if hashes else ROOT_HASH
    tokens = token_ids[first * block_size : count * block_size]  # one slice, not one per block
    for start in range(0, (count - first) * block_size, block_size):
        parent = hash((parent, *tokens[start : start + block_size]))  # block_hash, inlined
        hashes.append(parent)
    return hashes


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slots_of(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of token positions [start, end): slot = block * block_size + offset."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        # where a cached block's tokens are: (a token list, the block's first index in it, the
        # block before it and that block's generation then; None for a first block)
        self.block_tokens: list[tuple[Sequence[int], int, tuple[int, int] | None] | None] = [
            None
        ] * num_blocks
        self.generations = [0] * num_blocks  # bumped when a block leaves the cache
        self.hash_to_block: dict[int, int] = {}
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.prefix_queries = 0
        self.prefix_hits = 0
        # (hashes, stored): hashes entered (True) or left (False) the prefix cache, in order;
        # called once per operation that changed any
        self.on_cache_change: Callable[[list[int], bool], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match_prefix(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> list[int]:
        """Cached full blocks holding the longest prefix of `token_ids`, in order; takes nothing.
        `hashes`: the token list's block hashes known so far (extended as far as it looks)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = [] if hashes is None else hashes
        block_ids: list[int] = []
        parent: tuple[int, int] | None = None
        for i in range(len(token_ids) // bs):
            if i == len(hashes):
                chain_hashes(token_ids, bs, hashes, i + 1)
            block = self.hash_to_block.get(hashes[i])
            if block is None or not self._holds(block, token_ids, i * bs, parent):
                break
            block_ids.append(block)
            parent = (block, self.generations[block])
        return block_ids

    def _holds(
        self, block: int, token_ids: Sequence[int], start: int, parent: tuple[int, int] | None
    ) -> bool:
        """The cached block holds token_ids[start : start + block_size], computed after `parent`
        (the block matched before it, and its generation): no collision."""
        where = self.block_tokens[block]
        assert where is not None
        ids, at, after = where
        if at != start or after != parent:
            return False
        bs = self.block_size
        return list(ids[at : at + bs]) == list(token_ids[start : start + bs])

    def count_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_queried_tokens
        self.prefix_hits += num_hit_tokens

    def take_cached(self, block_ids: list[int]) -> None:
        """Adds a reference to each matched block (from `match_prefix`)."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1

    def allocate_prefix(self, hits: list[int], num_tokens: int) -> list[int] | None:
        """A block table for a sequence's first `num_tokens` tokens whose leading blocks are the
        prefix-cache `hits` (from match_prefix): takes the hits and allocates the rest. None, and
        nothing taken, when they do not fit (a hit that is only cached still costs a free block)."""
        num_new = num_blocks_for(num_tokens, self.block_size) - len(hits)
        num_evictable = sum(1 for b in hits if self.ref_counts[b] == 0)
        if num_new + num_evictable > self.num_free_blocks:
            return None
        self.take_cached(hits)
        return hits + self.allocate(num_new)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, each with one reference. Raises if fewer are free."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free_blocks} free")
        # Never-cached blocks first, then the least recently cached ones, which leave the cache.
        # (Per-block loops with their lookups hoisted: an 8,000-token prompt is 500 blocks.)
        free, ref_counts = self.free, self.ref_counts
        fresh = min(count, len(free))
        if fresh == len(free):
            blocks = list(free)
            free.clear()
        else:
            popleft = free.popleft
            blocks = [popleft() for _ in range(fresh)]
        if count > fresh:
            blocks.extend(self._evict(count - fresh))
        for block in blocks:
            ref_counts[block] = 1
        return blocks

    def _evict(self, count: int) -> list[int]:
        """Takes the `count` least recently cached blocks out of the cache. Each one's hash maps
        to it: a block becomes evictable only so (`free_blocks`), and while it is, no other
        block can take its hash (`cache_full_blocks` maps only hashes not mapped yet)."""
        popitem, hashes, where = self.evictable.popitem, self.hashes, self.block_tokens
        generations = self.generations
        blocks = [popitem(last=False)[0] for _ in range(count)]
        digests = [hashes[block] for block in blocks]
        for digest in digests:
            del self.hash_to_block[digest]  # type: ignore[arg-type]
        for block in blocks:
            hashes[block] = None
            where[block] = None
            generations[block] += 1
        if self.on_cache_change is not None:
            self.on_cache_change(digests, False)  # type: ignore[arg-type]
        return blocks

    def cache_full_blocks(
        self,
        block_table: list[int],
        token_ids: Sequence[int],
        num_hashed: int,
        num_full: int,
        hashes: list[int] | None = None,
    ) -> None:
        """Registers blocks num_hashed .. num_full-1 of a block table, now full of computed KV.
        `hashes`: the token list's block hashes known so far (extended to num_full)."""
        if not self.enable_prefix_caching:
            return
        if hashes is None:
            hashes = [self.hashes[b] for b in block_table[:num_hashed]]  # type: ignore[misc]
        chain_hashes(token_ids, self.block_size, hashes, num_full)
        bs, table_hashes, where = self.block_size, self.hashes, self.block_tokens
        hash_to_block, generations = self.hash_to_block, self.generations
        stored = []
        for i in range(num_hashed, num_full):
            block, digest = block_table[i], hashes[i]
            if table_hashes[block] is None:
                table_hashes[block] = digest
                before = block_table[i - 1] if i else None
                parent = None if before is None else (before, generations[before])
                where[block] = (token_ids, i * bs, parent)
                # A twin computed concurrently keeps the entry; this copy is freed as a miss.
                if digest not in hash_to_block:
                    hash_to_block[digest] = block
                    stored.append(digest)
        if stored and self.on_cache_change is not None:
            self.on_cache_change(stored, True)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drops one reference per block; the last reference makes it cached or free."""
        ref_counts, hashes, hash_to_block = self.ref_counts, self.hashes, self.hash_to_block
        evictable, free, where = self.evictable, self.free, self.block_tokens
        for block in reversed(block_ids):  # tail blocks become evictable first
            ref_counts[block] -= 1
            if ref_counts[block] > 0:
                continue
            digest = hashes[block]
            if digest is not None and hash_to_block.get(digest) == block:
                evictable[block] = None
                continue
            if digest is not None:  # a twin's copy: blocks computed after it name it
                self.generations[block] += 1
            hashes[block] = None
            where[block] = None
            free.append(block)  # never cached, or a twin's copy (its hash maps elsewhere)
