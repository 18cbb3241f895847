"""Block manager: which KV blocks are free, who holds them, and which hold a cached prefix.

Pure Python (no torch). A full block is identified by a chained hash

    hash(block i) = hash((hash(block i-1), *tokens of block i))

so equal hashes mean equal prefixes, barring a collision; every hit re-checks the tokens.

A block is in exactly one state:
    held       ref_count > 0, in some sequence's block table
    cached     ref_count == 0 with a hash: reusable as a prefix, evicted least recently used first
    free       ref_count == 0 without a hash
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    # Python hashes int tuples the same in every process (no per-process salt), which lets
    # workers compare prefix hashes with each other.
    return hash((parent, *tokens))


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
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.prefix_queries = 0
        self.prefix_hits = 0
        # (hash, stored): a hash entered (True) or left (False) the prefix cache
        self.on_cache_change: Callable[[int, bool], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached full blocks holding the longest prefix of `token_ids`, in order; takes nothing."""
        if not self.enable_prefix_caching:
            return []
        bs, parent = self.block_size, None
        block_ids: list[int] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            parent = block_hash(parent, tokens)
            block = self.hash_to_block.get(parent)
            if block is None or self.block_tokens[block] != tokens:
                break
            block_ids.append(block)
        return block_ids

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
        return [self._take_fresh() for _ in range(count)]

    def _take_fresh(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        digest = self.hashes[block]
        if digest is not None and self.hash_to_block.get(digest) == block:
            del self.hash_to_block[digest]
            if self.on_cache_change is not None:
                self.on_cache_change(digest, False)
        self.hashes[block] = None
        self.block_tokens[block] = None

    def cache_full_blocks(
        self, block_table: list[int], token_ids: Sequence[int], num_hashed: int, num_full: int
    ) -> None:
        """Registers blocks num_hashed .. num_full-1 of a block table, now full of computed KV."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = self.hashes[block_table[num_hashed - 1]] if num_hashed else None
        for i in range(num_hashed, num_full):
            block, tokens = block_table[i], tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, tokens)
            if self.hashes[block] is None:
                self.hashes[block], self.block_tokens[block] = parent, tokens
                # A twin computed concurrently keeps the entry; this copy is freed as a miss.
                if parent not in self.hash_to_block:
                    self.hash_to_block[parent] = block
                    if self.on_cache_change is not None:
                        self.on_cache_change(parent, True)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drops one reference per block; the last reference makes it cached or free."""
        for block in reversed(block_ids):  # tail blocks become evictable first
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:
                continue
            if (
                self.hashes[block] is not None
                and self.hash_to_block.get(self.hashes[block]) == block
            ):
                self.evictable[block] = None
            else:
                self._forget(block)
                self.free.append(block)
