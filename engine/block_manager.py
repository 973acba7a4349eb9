"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, prefix caching.

A full block is identified by a chained hash: hash(parent block's hash, the block's token ids),
so equal hashes mean equal prefixes, not only equal blocks. A hit is confirmed against the token
ids stored with the block, so a hash collision can only cost a miss, never wrong KV.

Freed blocks keep their hash and content until they are reused: the free list is kept in
eviction order (least recently freed first), and a later request with the same prefix revives
them without recomputing. Only full blocks are ever shared, and a shared block is never written
again (the first token a request computes always lands in a block of its own).
"""

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b

from engine.sequence import Sequence

ROOT_HASH = b""


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def root_hash(cache_salt: str) -> bytes:
    """The chain's start: requests with different salts never share a cached block, so one
    tenant cannot learn from hits (cached-token counts, time to first token) what another sent."""
    return blake2b(cache_salt.encode(), digest_size=16).digest() if cache_salt else ROOT_HASH


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full, computed and registered
    token_ids: tuple[int, ...] = ()  # content of a registered block, to confirm hits


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # chain hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    # -- prefix cache -----------------------------------------------------------------------

    def _hash_full_blocks(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = seq.block_hashes
        bs = self.block_size
        tokens = seq.token_ids
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else root_hash(seq.params.cache_salt)
            hashes.append(chain_hash(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq` (which holds no blocks yet). At least one
        token is left to compute, so the request still produces logits."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self._hash_full_blocks(seq, max_blocks)
        hits = []
        for i in range(max_blocks):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break  # a collision: treat as a miss
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count an admitted request's lookup (a request that waits on is looked up again)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_registered_blocks
        if num_full <= start:
            return
        hashes = self._hash_full_blocks(seq, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            h = hashes[i]
            if h in self.cached:  # the same prefix computed twice at once: keep the first
                continue
            block = self.blocks[seq.block_table[i]]
            block.hash = h
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.cached[h] = block.block_id
        seq.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> int:
        """Forget the cached content of every free block, so that later requests compute their
        prompts afresh (benchmarks repeating a workload, cache invalidation). Blocks held by
        running requests keep theirs. Returns how many blocks were forgotten."""
        forgotten = 0
        for block_id in self.free:
            forgotten += self._evict(self.blocks[block_id])
        return forgotten

    def _evict(self, block: Block) -> bool:
        """Forget a free block's cached content; whether it had any."""
        if block.hash is None:
            return False
        if self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
        block.hash = None
        block.token_ids = ()
        return True

    # -- allocation -------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """New blocks for `num_new_tokens` after the computed tokens (and after the prefix
        hits of a request being admitted, which hold full blocks of computed tokens)."""
        held = len(seq.block_table) + num_hit_blocks
        computed = seq.num_computed_tokens + num_hit_blocks * self.block_size
        return -(-(computed + num_new_tokens) // self.block_size) - held

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> bool:
        # Hit blocks nobody holds sit in the free list and leave it when revived.
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(seq, num_new_tokens, len(hits)) + revived <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> None:
        """Give `seq` blocks for `num_new_tokens` more tokens (after reviving `hits`, whose
        tokens count as computed). The caller checked `can_allocate`."""
        blocks = self.blocks
        for block_id in hits:
            block = blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if hits:
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_registered_blocks = len(hits)
            seq.timeline.num_cached_tokens = max(
                seq.timeline.num_cached_tokens, seq.num_computed_tokens
            )
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block_id, _ = self.free.popitem(last=False)
            block = blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block_id)

    def free_seq(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks. Tail blocks are freed first so that they are
        evicted before the prefix blocks other requests are more likely to share."""
        blocks = self.blocks
        for block_id in reversed(seq.block_table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
