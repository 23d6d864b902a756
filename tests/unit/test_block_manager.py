"""BlockManager bookkeeping: ref counts, prefix-cache hits with token checks, LRU reuse of freed blocks."""
import pytest

from livemoe.engine.decoder.block_manager import BlockManager
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.decoder.sequence import Sequence

BS = 4


def seq(tokens):
    return Sequence(list(tokens), SamplingParams())


def run_prefill(bm, s):
    """Allocates and 'computes' the whole sequence, as the scheduler would across chunks."""
    n = bm.allocate(s, 10**6)
    assert n > 0
    s.num_computed_tokens += n
    bm.cache_blocks(s)
    return n


def check_invariants(bm, live):
    refs = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_block_ids) == {i for i, r in enumerate(refs) if r == 0}
    for h, b in bm.hash_to_block_id.items():
        assert bm.blocks[b].hash == h


def test_allocate_and_free_counts():
    bm = BlockManager(8, BS)
    s = seq(range(10))  # 3 blocks
    assert run_prefill(bm, s) == 10
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert len(bm.hash_to_block_id) == 2  # the two full blocks
    check_invariants(bm, [s])
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == [] and s.num_computed_tokens == 0
    check_invariants(bm, [])


def test_prefix_hit_shares_blocks_and_counts():
    bm = BlockManager(16, BS)
    a = seq(list(range(100, 112)) + [1, 2])  # 3 full blocks + 2
    run_prefill(bm, a)
    b = seq(list(range(100, 112)) + [7, 8, 9])
    n = bm.allocate(b, 100)
    # all 3 full blocks hit; b computes the rest
    assert b.num_computed_tokens == 12 and n == 3
    assert b.block_table[:3] == a.block_table[:3]
    assert [bm.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    assert bm.stats.hits == 12 and bm.stats.queries == 14 + 15
    check_invariants(bm, [a, b])


def test_last_token_always_recomputed():
    bm = BlockManager(16, BS)
    a = seq(range(8))  # exactly 2 full blocks
    run_prefill(bm, a)
    b = seq(range(8))
    n = bm.allocate(b, 100)
    # only the first block may hit: a hit on the second would leave no token to compute
    assert b.num_computed_tokens == 4 and n == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_chain_hash_depends_on_prefix():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(bm, a)
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 9])  # same second block, different first
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 0


def test_token_check_rejects_hash_collision():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    # forge a collision: the hash now points at a block whose tokens differ
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (1, 2, 3, 99)
    b = seq([1, 2, 3, 4, 5])
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 0


def test_freed_blocks_keep_hash_and_reuse_least_recently_freed_first():
    bm = BlockManager(6, BS)
    a = seq(range(9))  # blocks: 2 full + 1 partial
    run_prefill(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    # a's blocks are at the back of the free list (most recently freed): fresh blocks go first
    c = seq(range(50, 55))  # needs 2 blocks
    run_prefill(bm, c)
    assert not set(c.block_table) & set(a_blocks)
    # a's prefix is still cached after it was freed
    b = seq(list(range(9)) + [77])
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a_blocks[:2]
    check_invariants(bm, [b, c])


def test_eviction_drops_hash():
    bm = BlockManager(3, BS)
    a = seq(range(5))
    run_prefill(bm, a)
    bm.free(a)
    c = seq(range(100, 111))  # takes all 3 blocks, evicting a's cached block
    run_prefill(bm, c)
    assert all(bm.blocks[b].hash != a.block_hashes[:1] for b in c.block_table)
    bm.free(c)
    b = seq(range(5))
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 0
    check_invariants(bm, [b])


def test_allocate_partial_when_blocks_short_and_zero_when_none():
    bm = BlockManager(2, BS)
    s = seq(range(20))
    assert bm.allocate(s, 100) == 8  # only 2 blocks' worth
    other = seq(range(3))
    assert bm.allocate(other, 100) == 0 and other.block_table == []


def test_recompute_counted_apart():
    bm = BlockManager(16, BS)
    a = seq(range(9))
    run_prefill(bm, a)
    q, h = bm.stats.queries, bm.stats.hits
    bm.free(a)
    a.num_preemptions = 1
    bm.allocate(a, 100)
    assert (bm.stats.queries, bm.stats.hits) == (q, h)
    assert bm.stats.recompute_hits == 8 and bm.stats.recompute_queries == 9


def test_append_slots_and_can_append():
    bm = BlockManager(3, BS)
    s = seq(range(4))
    run_prefill(bm, s)
    assert len(s.block_table) == 1
    s.append_token(5)
    assert bm.blocks_needed(s, 1) == 1 and bm.can_append(s, 1)
    bm.append_slots(s, 1)
    assert len(s.block_table) == 2
    assert not bm.can_append(s, 9) and bm.can_append(s, 8)
    # short of blocks: try_append_slots says so and changes nothing
    table, free = list(s.block_table), bm.num_free_blocks
    assert not bm.try_append_slots(s, 9)
    assert s.block_table == table and bm.num_free_blocks == free
    check_invariants(bm, [s])


def test_prefix_caching_off():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = seq(range(9))
    run_prefill(bm, a)
    b = seq(range(9))
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 0 and not bm.hash_to_block_id


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_invariants(seed):
    import random

    rng = random.Random(seed)
    bm = BlockManager(24, BS)
    live = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    for _ in range(200):
        if live and rng.random() < 0.4:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        else:
            s = seq(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))])
            n = bm.allocate(s, 10**6)
            if n == 0:
                continue
            s.num_computed_tokens += n
            bm.cache_blocks(s)
            live.append(s)
            # a cached block must hold exactly the tokens the sequence has there
            for i, b in enumerate(s.block_table[: s.num_computed_tokens // BS]):
                if bm.blocks[b].hash is not None:
                    assert bm.blocks[b].token_ids == tuple(s.block_tokens(i, BS))
        check_invariants(bm, live)


def test_same_step_sharing():
    """Blocks are registered when allocated (their K/V are written in that step, before any attention),
    so a sequence admitted in the same step shares them."""
    bm = BlockManager(16, BS)
    a = seq(range(10))
    assert bm.allocate(a, 100) == 10 and a.num_computed_tokens == 0  # not computed yet
    b = seq(list(range(8)) + [50, 51])
    bm.allocate(b, 100)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    # a chunk registers only the blocks it fills
    c = seq(range(100, 120))
    bm.allocate(c, 6)
    assert len(c.block_hashes) == 1
    c.num_computed_tokens += 6
    bm.append_slots(c, 6)
    assert len(c.block_hashes) == 3
