import pytest

import engine.block_manager as block_manager_module
from engine.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(), seed=0)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """Admit `s` with its prefix hits and compute every token, as a whole-prompt step would."""
    hits = bm.match_prefix(s)
    n = s.num_tokens - len(hits) * BS
    assert bm.can_allocate(s, n, hits)
    bm.allocate(s, n, hits)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.usage == 0.0


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    s = seq(range(10))
    compute_all(bm, s)
    assert len(s.block_table) == 3  # 10 tokens in blocks of 4
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.free_seq(s)
    assert_all_free(bm)
    assert s.block_table == [] and s.num_computed_tokens == 0


def test_blocks_grow_one_at_a_time_for_decodes():
    bm = BlockManager(8, BS)
    s = seq(range(4))
    compute_all(bm, s)
    assert len(s.block_table) == 1
    s.token_ids.append(99)  # a sampled token: its KV goes to a new block
    assert bm.blocks_needed(s, 1) == 1
    bm.allocate(s, 1)
    s.num_computed_tokens += 1
    assert len(s.block_table) == 2
    s.token_ids.append(98)
    assert bm.blocks_needed(s, 1) == 0


def test_prefix_hit_shares_full_blocks_and_counts_references():
    bm = BlockManager(16, BS)
    a = seq(range(10), "a")
    compute_all(bm, a)  # blocks [0..3] and [4..7] are full and registered
    b = seq([*range(8), 50, 51, 52], "b")
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    compute_all_from_hits = b.num_tokens - 8
    bm.allocate(b, compute_all_from_hits, hits)
    assert b.num_computed_tokens == 8
    assert b.timeline.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    assert b.block_table[2] not in a.block_table  # the partial block is private
    bm.free_seq(a)
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    bm.free_seq(b)
    assert_all_free(bm)


def test_a_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(16, BS)
    a = seq(range(8), "a")
    compute_all(bm, a)
    same = seq(range(8), "b")  # identical, block-aligned prompt
    assert len(bm.match_prefix(same)) == 1  # the last block is recomputed for its logits


def test_hash_chains_the_prefix_not_only_the_block():
    bm = BlockManager(16, BS)
    compute_all(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    other_first_block = seq([0, 0, 0, 0, 5, 6, 7, 8, 9], "b")
    assert bm.match_prefix(other_first_block) == []


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = seq(range(9), "a")
    compute_all(bm, a)
    bm.free_seq(a)
    assert_all_free(bm)
    b = seq(range(9), "b")
    hits = bm.match_prefix(b)
    assert len(hits) == 2  # revived from the free list
    assert bm.can_allocate(b, 1, hits)
    bm.allocate(b, 1, hits)
    assert bm.num_free_blocks == 1
    bm.free_seq(b)
    # Fill the cache with other content: the old blocks are evicted, hits disappear.
    c = seq(range(100, 116), "c")
    compute_all(bm, c)
    bm.free_seq(c)
    assert bm.match_prefix(seq(range(9), "d")) == []


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = BlockManager(8, BS)
    done, running = seq(range(9), "done"), seq(range(50, 59), "running")
    compute_all(bm, done)
    compute_all(bm, running)
    bm.free_seq(done)
    assert bm.reset_prefix_cache() == 2  # done's two full blocks
    assert bm.match_prefix(seq(range(9), "again")) == []
    assert len(bm.match_prefix(seq(range(50, 59), "shared"))) == 2  # held: still cached
    bm.free_seq(running)
    assert bm.reset_prefix_cache() == 2
    assert bm.cached == {} and bm.reset_prefix_cache() == 0
    assert_all_free(bm)


def test_revived_blocks_count_against_free_blocks():
    bm = BlockManager(3, BS)
    a = seq(range(9), "a")
    compute_all(bm, a)
    bm.free_seq(a)
    b = seq([*range(8), 7, 7, 7, 7, 7, 7, 7, 7, 7], "b")  # 17 tokens: 2 hits + 3 new blocks
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    assert not bm.can_allocate(b, b.num_tokens - 8, hits)
    assert bm.can_allocate(b, 4, hits)  # 2 revived + 1 new = the 3 blocks there are


def test_hash_collision_is_a_miss_not_wrong_kv(monkeypatch):
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: b"same")
    bm = BlockManager(8, BS)
    compute_all(bm, seq([1, 2, 3, 4, 5], "a"))
    assert bm.match_prefix(seq([9, 9, 9, 9, 5], "b")) == []  # same hash, other tokens
    assert len(bm.match_prefix(seq([1, 2, 3, 4, 6], "c"))) == 1


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    compute_all(bm, seq(range(9), "a"))
    assert bm.match_prefix(seq(range(9), "b")) == []
    assert bm.cached == {}


def test_duplicate_content_computed_twice_registers_once():
    bm = BlockManager(8, BS)
    a, b = seq(range(5), "a"), seq(range(5), "b")
    for s in (a, b):  # admitted in the same step: neither hits the other
        bm.allocate(s, 5)
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_full_blocks(s)
    assert bm.cached[b.block_hashes[0]] == a.block_table[0]
    bm.free_seq(a)
    bm.free_seq(b)
    assert_all_free(bm)


def test_prefix_lookup_counters():
    bm = BlockManager(8, BS)
    compute_all(bm, seq(range(9), "a"))
    b = seq(range(9), "b")
    bm.record_prefix_lookup(b.num_tokens, len(bm.match_prefix(b)))
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (9, 8)
