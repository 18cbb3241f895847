"""Block manager at block_size 4: allocation, ref counts, prefix hits, collisions, eviction."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_manager import BlockManager, block_hash, chain_hashes, num_blocks_for

BS = 4


def make(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, BS)


def fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocates blocks for `tokens` as a new sequence and registers its full blocks."""
    table = bm.allocate(num_blocks_for(len(tokens), BS))
    bm.cache_full_blocks(table, tokens, 0, len(tokens) // BS)
    return table


def test_num_blocks_for_rounds_up() -> None:
    assert [num_blocks_for(n, BS) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_return_every_block() -> None:
    bm = make()
    table = bm.allocate(3)
    assert len(set(table)) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in table)
    bm.free_blocks(table)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocate_more_than_free_raises() -> None:
    bm = make(2)
    bm.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks, 0 free"):
        bm.allocate(1)


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    bm = make()
    prompt = list(range(10))  # two full blocks + 2 tokens
    table = fill(bm, prompt)
    hits = bm.match_prefix(prompt[:8] + [99, 98, 97])
    assert hits == table[:2]
    bm.take_cached(hits)
    assert [bm.ref_counts[b] for b in hits] == [2, 2]
    bm.free_blocks(table)
    assert [bm.ref_counts[b] for b in hits] == [1, 1]
    assert bm.num_free_blocks == 8 - 2


def test_partial_block_is_never_a_hit() -> None:
    bm = make()
    fill(bm, [1, 2, 3])
    assert bm.match_prefix([1, 2, 3]) == []


def test_chained_hash_depends_on_the_whole_prefix() -> None:
    bm = make()
    fill(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    # Same second block after a different first block: no hit at all.
    assert bm.match_prefix([9, 9, 9, 9, 5, 6, 7, 8]) == []
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(block_hash(None, [0]), [1, 2, 3, 4])


def test_hash_collision_is_caught_by_token_recheck() -> None:
    bm = make()
    table = fill(bm, [1, 2, 3, 4])
    # Forge a collision: another prefix's hash pointing at this block.
    forged = block_hash(None, [5, 6, 7, 8])
    bm.hash_to_block[forged] = table[0]
    assert bm.match_prefix([5, 6, 7, 8]) == []
    assert bm.match_prefix([1, 2, 3, 4]) == table[:1]


def test_a_collision_with_the_same_tokens_elsewhere_is_a_miss() -> None:
    """The token re-check compared only the block's own tokens: a prompt whose hash collided
    with a block holding the same tokens at another position, or after another prefix, got
    that block's KV (computed for another context). Python's int hashing is public and
    unkeyed, so such collisions can be searched for offline."""
    bm = make()
    a = fill(bm, [9, 9, 9, 9, 1, 2, 3, 4])
    a_hashes = [bm.hashes[b] for b in a]
    # [1, 2, 3, 4] as a first block, its hash forged to collide with a's second block
    assert bm.match_prefix([1, 2, 3, 4, 0], [a_hashes[1]]) == []
    # [8, 8, 8, 8, 1, 2, 3, 4]: its own first block cached, the second forged onto a's
    c = fill(bm, [8, 8, 8, 8])
    c_first = bm.hashes[c[0]]
    assert bm.match_prefix([8, 8, 8, 8, 1, 2, 3, 4], [c_first, a_hashes[1]]) == c
    # the real thing still hits in full
    assert bm.match_prefix([9, 9, 9, 9, 1, 2, 3, 4]) == a


def test_a_block_computed_after_an_evicted_parent_is_not_matched_through_its_reuse() -> None:
    bm = make(3)
    a = fill(bm, [1, 1, 1, 1, 2, 2, 2, 2])  # blocks a0, a1
    bm.free_blocks(a)  # a1 then a0 become evictable
    bm.evictable.move_to_end(a[1])  # a0 the least recently used: evicted first
    fill(bm, [3, 3, 3, 3])  # takes the one free block
    reused = bm.allocate(1)  # evicts a0: its id now holds other tokens
    assert reused == [a[0]]
    bm.cache_full_blocks(reused, [1, 1, 1, 1], 0, 1, [bm.hashes[a[1]] ^ 1])  # same tokens, new
    # a1 names a0 as it was: through the reused id it is not reached
    hashes = [bm.hashes[a[0]], bm.hashes[a[1]]]
    bm.hash_to_block[hashes[0]] = a[0]  # (forged: the reused block found under a0's old hash)
    assert bm.match_prefix([1, 1, 1, 1, 2, 2, 2, 2], hashes) == [a[0]]


def test_a_sequence_hashes_its_blocks_once_and_every_hit_still_checks_tokens() -> None:
    bm = make()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    table, hashes = bm.allocate(3), []
    bm.cache_full_blocks(table, tokens, 0, 2, hashes)  # fills the sequence's hash list
    first = block_hash(None, [1, 2, 3, 4])
    assert hashes == [first, block_hash(first, [5, 6, 7, 8])]
    known = list(hashes)
    assert bm.match_prefix(tokens, known) == table[:2] and known == hashes  # nothing rehashed
    # Hashes that belong to other tokens find blocks, but the tokens do not match: a miss.
    assert bm.match_prefix([9, 9, 9, 9, 5, 6, 7, 8], list(hashes)) == []
    # A lookup extends a short list only as far as it looks (the first block misses here).
    partial: list[int] = []
    assert bm.match_prefix([7, 7, 7, 7, 7, 7, 7, 7], partial) == [] and len(partial) == 1


def test_freed_cached_blocks_stay_matchable_until_evicted() -> None:
    bm = make(4)
    table = fill(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    bm.free_blocks(table)
    assert bm.num_free_blocks == 4  # cached blocks count as free
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == table


def test_eviction_takes_never_cached_blocks_first_then_least_recently_freed() -> None:
    bm = make(4)
    old = fill(bm, [1, 2, 3, 4])
    new = fill(bm, [5, 6, 7, 8])
    bm.free_blocks(old)  # freed first: least recently used
    bm.free_blocks(new)
    fresh = bm.allocate(2)  # the two never-cached blocks go first
    assert set(fresh).isdisjoint(old + new)
    assert bm.match_prefix([1, 2, 3, 4]) == old
    evicted = bm.allocate(1)
    assert evicted == old
    assert bm.match_prefix([1, 2, 3, 4]) == []
    assert bm.match_prefix([5, 6, 7, 8]) == new


def test_taking_a_cached_block_removes_it_from_eviction() -> None:
    bm = make(2)
    table = fill(bm, [1, 2, 3, 4])
    bm.free_blocks(table)
    bm.take_cached(bm.match_prefix([1, 2, 3, 4]))
    assert bm.num_free_blocks == 1
    assert bm.allocate(1) != table
    with pytest.raises(RuntimeError):
        bm.allocate(1)


def test_abort_mid_sequence_frees_everything() -> None:
    bm = make(6)
    shared = fill(bm, [1, 2, 3, 4])
    bm.take_cached(shared)
    second = shared + bm.allocate(2)  # a second sequence on top of the shared prefix
    bm.free_blocks(shared)  # first sequence finishes
    bm.free_blocks(second)  # second one is aborted half way
    assert bm.num_free_blocks == 6
    assert all(count == 0 for count in bm.ref_counts)


def test_prefix_caching_off_never_matches() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    fill(bm, [1, 2, 3, 4])
    assert bm.match_prefix([1, 2, 3, 4]) == []


def test_block_hashes_are_the_same_in_every_process() -> None:
    # The router compares its prompt hashes with the hashes workers (other processes) report.
    code = (
        "from engine.block_manager import chain_hashes; "
        "print(chain_hashes(list(range(40)), 4, [], 10))"
    )
    root = Path(__file__).resolve().parents[2]
    theirs = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    assert theirs.strip() == str(chain_hashes(list(range(40)), BS, [], 10))
