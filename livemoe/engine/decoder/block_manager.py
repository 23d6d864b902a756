"""BlockManager: ref-counted KV-cache blocks, per-sequence block tables, and prefix caching.

A full block is identified by a chained hash (its tokens and the hash of the block before it) plus a
token check against collisions. Freed blocks keep their hash, so a later request with the same prefix
can take them back; a new block is taken least-recently-freed first, which evicts the oldest cache.
At least one prompt token is always recomputed (its logits start the output), so a cache hit never
covers the last prompt token and a step never writes into a shared block.

A block is registered as soon as it is allocated for tokens that fill it: its K/V are written in that
same step, and every layer stores the whole step's K/V before it attends, so a sequence admitted in
the same step may already share it.

Pinning (live sessions, livemoe.engine.live): a caller asks `pin_on_finish(request_id, holder)` before the
request runs (a request of one sequence); when its sequence finishes, `free` keeps one reference on its blocks for `holder` (a `Pin`, swapped for the holder's
previous one), so no other request can evict them, and registers its partially filled last block as a
pinned tail. The next request whose prompt continues those tokens takes the full blocks by hash and the
tail by `pinned_tails` (it writes after the tail's tokens, so it must be the tail's only other user):
each interval of a session prefills only its new tokens. Pins are capped at `max_pinned_blocks`.

Pure bookkeeping: no tensors. The scheduler calls `allocate` (first chunk of a waiting sequence),
`append_slots` (each later step) and `free`.
"""
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol, cast

from livemoe.engine.decoder.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class Pin:
    """Blocks kept for a holder between its requests: one reference each; the last may be a partial tail."""
    __slots__ = ("manager", "block_ids", "num_tokens", "tail_key")

    def __init__(self, manager: "BlockManager", block_ids: list[int], num_tokens: int, tail_key):
        self.manager, self.block_ids, self.num_tokens, self.tail_key = manager, block_ids, num_tokens, tail_key


class PinHolder(Protocol):
    """What pin_on_finish keeps a finished request's blocks for (a live session): its current Pin."""
    pin: Pin | None


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
        # pinning: at most half the cache by default, so pinned sessions cannot starve other requests
        self.max_pinned_blocks = num_blocks // 2
        self.num_pinned_blocks = 0
        self.pinned_tails: dict = {}  # hash of the full blocks before (None: none) -> [(block_id, tokens)]
        self._pin_on_finish: dict[str, PinHolder] = {}  # request_id -> holder
        self._unpin_later: deque = deque()  # pins given back from another thread (appends are atomic)

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
        self.pinned_tails.clear()
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
        while self._unpin_later:
            self.unpin(self._unpin_later.popleft())
        hits = [] if seq.uncached_prefill else self.match_prefix(seq)
        num_full = len(hits)
        tail = None if seq.uncached_prefill else self._match_tail(seq, hits)
        if tail is not None:
            hits.append(tail[0])
        num_cached = num_full * self.block_size + (len(tail[1]) if tail is not None else 0)
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
        if tail is not None:  # one writer after the tail's tokens: no one else may take it
            self._drop_tail(self.blocks[hits[num_full - 1]].hash if num_full else None, tail[0])
        seq.block_table = list(hits)
        seq.num_computed_tokens = num_cached
        # full-block hits are cached blocks: each has its hash
        seq.block_hashes = cast(list[int], [self.blocks[b].hash for b in hits[:num_full]])
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

    def _match_tail(self, seq: Sequence, hits: list[int]):
        """(block_id, tokens) of a pinned tail continuing seq's full-block hits, or None. Never covers
        seq's last token; only a tail no one else holds (its pin alone), since seq writes after it."""
        if not self.pinned_tails:
            return None
        start = len(hits) * self.block_size
        best = None
        for block_id, tokens in self.pinned_tails.get(self.blocks[hits[-1]].hash if hits else None, ()):
            if (start + len(tokens) < len(seq) and self.blocks[block_id].ref_count == 1
                    and tuple(seq.cache_keys(start, start + len(tokens))) == tokens
                    and (best is None or len(tokens) > len(best[1]))):
                best = (block_id, tokens)
        return best

    def _drop_tail(self, key, block_id: int) -> None:
        tails = self.pinned_tails.get(key, [])
        tails[:] = [t for t in tails if t[0] != block_id]
        if not tails:
            self.pinned_tails.pop(key, None)

    # -- pinning ------------------------------------------------------------------------------------

    def pin_on_finish(self, request_id: str, holder: PinHolder) -> None:
        """When the request's sequence finishes (not when it is preempted), its blocks become holder.pin
        (replacing and releasing holder's previous Pin), within the pin budget. Keyed by request id, so
        it can be asked before the request exists."""
        self._pin_on_finish[request_id] = holder

    def cancel_pin_on_finish(self, request_id: str) -> None:
        self._pin_on_finish.pop(request_id, None)

    def _pin(self, seq: Sequence, previous: Pin | None) -> Pin | None:
        n = seq.num_computed_tokens
        num_full = min(n // self.block_size, len(seq.block_hashes))
        has_tail = num_full == n // self.block_size and n % self.block_size > 0
        num_blocks = num_full + has_tail
        budget = self.max_pinned_blocks - self.num_pinned_blocks + (len(previous.block_ids) if previous else 0)
        if num_blocks > budget:  # keep the head that fits: a session's oldest tokens are its most shared
            num_full, has_tail = min(num_full, max(0, budget)), False
            num_blocks = num_full
        if num_blocks == 0 or not self.enable_prefix_caching:
            return None
        block_ids = seq.block_table[:num_blocks]
        for b in block_ids:
            self.blocks[b].ref_count += 1
        self.num_pinned_blocks += num_blocks
        tail_key = None
        if has_tail:
            tail_key = seq.block_hashes[num_full - 1] if num_full else None
            self.pinned_tails.setdefault(tail_key, []).append((block_ids[-1],
                                                               tuple(seq.cache_keys(num_full * self.block_size, n))))
        return Pin(self, block_ids, num_full * self.block_size + (n % self.block_size if has_tail else 0),
                   tail_key if has_tail else False)

    def unpin(self, pin: Pin | None) -> None:
        """Gives a Pin's blocks back (they stay in the prefix cache, evictable). A Pin of an earlier
        cache (the KV cache was released and made again since) is ignored."""
        if pin is None or pin.manager is not self or not pin.block_ids:
            return
        if pin.tail_key is not False:
            self._drop_tail(pin.tail_key, pin.block_ids[-1])
        for block_id in reversed(pin.block_ids):
            self._release(block_id)
        self.num_pinned_blocks -= len(pin.block_ids)
        pin.block_ids = []

    def unpin_later(self, pin: Pin | None) -> None:
        """unpin from a thread other than the one stepping the engine: done at the next allocation."""
        if pin is not None:
            self._unpin_later.append(pin)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, block_id
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

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
        # a block is registered once its committed tokens fill it: speculative drafts may yet be rejected
        committed = min(total, len(seq.token_ids) - seq.num_draft_tokens)
        if self.enable_prefix_caching and committed // self.block_size > len(seq.block_hashes):
            self.cache_blocks(seq, committed)
        return True

    def trim(self, seq: Sequence) -> None:
        """After a verification: gives back the blocks past those seq's tokens need (rejected drafts' slots; none
        of them was registered) and registers the blocks its accepted drafts filled."""
        keep = -(-len(seq.token_ids) // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        if self.enable_prefix_caching and seq.num_computed_tokens // self.block_size > len(seq.block_hashes):
            self.cache_blocks(seq)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """try_append_slots where the caller knows the blocks are there (can_append)."""
        ok = self.try_append_slots(seq, num_new_tokens)
        assert ok, (self.blocks_needed(seq, num_new_tokens), self.num_free_blocks)

    def free(self, seq: Sequence) -> None:
        while self._unpin_later:
            self.unpin(self._unpin_later.popleft())
        if self._pin_on_finish and seq.finish_reason is not None:
            holder = self._pin_on_finish.pop(seq.request_id, None)
            if holder is not None:
                pin = self._pin(seq, holder.pin)
                self.unpin(holder.pin)
                holder.pin = pin
        # last blocks first, so a sequence's tail is evicted before its (more shareable) head
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = seq.num_draft_computed = 0  # both caches' K/V go with the blocks
