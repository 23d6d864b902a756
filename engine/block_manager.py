"""BlockManager: ref-counted KV-cache blocks, per-sequence block tables, and prefix caching.

A full block is identified by a chained hash (its tokens and the hash of the block before it) plus a
token check against collisions. Freed blocks keep their hash, so a later request with the same prefix
can take them back; a new block is taken least-recently-freed first, which evicts the oldest cache.
At least one prompt token is always recomputed (its logits start the output), so a cache hit never
covers the last prompt token and a step never writes into a shared block.

A block is registered as soon as it is allocated for tokens that fill it: its K/V are written in that
same step, and every layer stores the whole step's K/V before it attends, so a sequence admitted in
the same step may already share it.

Pure bookkeeping: no tensors. The scheduler calls `allocate` (first chunk of a waiting sequence),
`append_slots` (each later step) and `free`.
"""
from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    """Token counts. `queries/hits` count fresh requests only; recomputation after preemption is apart."""
    queries: int = 0
    hits: int = 0
    recompute_queries: int = 0
    recompute_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def chain_hash(token_ids: tuple[int, ...], prefix_hash: int | None) -> int:
    # hash() of a tuple of ints is deterministic across processes (no string hashing involved)
    return hash((prefix_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.hash_to_block_id: dict[int, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that seq's table holds num_computed + num_new_tokens tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # -- prefix cache -------------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding seq's longest cached prefix of full blocks, never covering its last token."""
        if not self.enable_prefix_caching:
            return []
        hits, h = [], None
        for i in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            h = chain_hash(tokens, h)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def cache_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Registers the hashes of seq's blocks that are full within its first num_tokens tokens
        (default: the computed ones)."""
        if not self.enable_prefix_caching:
            return
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        h = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_tokens // self.block_size):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            h = chain_hash(tokens, h)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block_id:  # else an equal block is already known
                block.hash, block.token_ids = h, tokens
                self.hash_to_block_id[h] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (e.g. after the weights changed: the cached K/V are stale)."""
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()

    # -- allocation ---------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]  # evicted from the prefix cache
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def allocate(self, seq: Sequence, token_budget: int) -> int:
        """First scheduling of a waiting seq: takes its cached prefix, then blocks for at most
        token_budget new tokens (fewer if blocks run short). Returns how many new tokens to compute;
        0 means nothing was changed."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        hits = self.match_prefix(seq)
        num_cached = len(hits) * self.block_size
        hit_blocks_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        available = self.num_free_blocks - hit_blocks_free
        num_new = min(token_budget, len(seq) - num_cached, (len(hits) + available) * self.block_size - num_cached)
        if num_new <= 0:
            return 0
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_computed_tokens = num_cached
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        for _ in range(self.blocks_needed(seq, num_new)):
            seq.block_table.append(self._take_free_block())
        self.cache_blocks(seq, num_cached + num_new)
        if seq.num_preemptions:
            self.stats.recompute_queries += len(seq)
            self.stats.recompute_hits += num_cached
        else:
            self.stats.queries += seq.num_prompt_tokens
            self.stats.hits += num_cached
            seq.num_cached_prompt_tokens = num_cached
        return num_new

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def try_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Adds blocks so a running seq can hold num_new_tokens more computed tokens; False (nothing
        changed) when there are not enough free blocks. The scheduler's per-sequence call of every step,
        so the common decode case (no new block, no block filled) does no more than two comparisons."""
        assert seq.block_table, seq
        total = seq.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size) - len(seq.block_table)
        if needed > 0:
            if needed > len(self.free_block_ids):
                return False
            for _ in range(needed):
                seq.block_table.append(self._take_free_block())
        if self.enable_prefix_caching and total // self.block_size > len(seq.block_hashes):
            self.cache_blocks(seq, total)
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """try_append_slots where the caller knows the blocks are there (can_append)."""
        ok = self.try_append_slots(seq, num_new_tokens)
        assert ok, (self.blocks_needed(seq, num_new_tokens), self.num_free_blocks)

    def free(self, seq: Sequence) -> None:
        # last blocks first, so a sequence's tail is evicted before its (more shareable) head
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, block_id
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
