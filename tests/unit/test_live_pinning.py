"""BlockManager pinning for live sessions: a finished sequence's blocks kept for its holder (partial
tail included), taken back by the holder's next request, capped by a budget, released by unpin."""
from itertools import count

from livemoe.engine.decoder.block_manager import BlockManager
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.decoder.sequence import Sequence

BS = 4
IDS = count()


class Holder:
    pin = None


def finished(bm, tokens, holder):
    """A sequence computed over `tokens`, then finished."""
    s = Sequence(list(tokens), SamplingParams(), request_id=f"r{next(IDS)}")
    bm.pin_on_finish(s.request_id, holder)
    n = bm.allocate(s, 10**6)
    s.num_computed_tokens += n
    bm.cache_blocks(s)
    s.finish_reason = "stop"
    bm.free(s)
    return s


def refs(bm):
    return sum(b.ref_count for b in bm.blocks)


def test_finished_sequence_blocks_stay_pinned_and_the_next_request_takes_the_tail():
    bm = BlockManager(16, BS)
    h = Holder()
    a = finished(bm, range(10), h)  # 2 full blocks + a tail of 2 tokens
    assert h.pin is not None and h.pin.num_tokens == 10 and len(h.pin.block_ids) == 3
    assert bm.num_pinned_blocks == 3 and bm.num_free_blocks == 13 and refs(bm) == 3
    tail_block = h.pin.block_ids[-1]
    nxt = Sequence(list(range(10)) + [50, 51, 52], SamplingParams())
    n = bm.allocate(nxt, 100)
    assert nxt.num_computed_tokens == 10 and n == 3  # only the new tokens: the tail's 2 tokens were cached
    assert nxt.block_table[:3] == h.pin.block_ids and nxt.block_table[2] == tail_block
    assert bm.stats.hits == 10
    # the tail has one writer: a second continuation does not get it
    other = Sequence(list(range(10)) + [60, 61], SamplingParams())
    bm.allocate(other, 100)
    assert other.num_computed_tokens == 8 and tail_block not in other.block_table
    del a


def test_a_tail_whose_tokens_differ_or_that_would_cover_the_last_token_is_not_taken():
    bm = BlockManager(16, BS)
    h = Holder()
    finished(bm, range(10), h)
    diff = Sequence(list(range(8)) + [8, 99, 5], SamplingParams())
    bm.allocate(diff, 100)
    assert diff.num_computed_tokens == 8
    exact = Sequence(list(range(10)), SamplingParams())  # the tail would cover its last token
    bm.allocate(exact, 100)
    assert exact.num_computed_tokens == 8


def test_the_holders_next_finish_swaps_the_pin_and_the_count_stays_right():
    bm = BlockManager(16, BS)
    h = Holder()
    finished(bm, range(10), h)
    first = h.pin
    finished(bm, list(range(10)) + [20, 21, 22, 23, 24], h)  # 15 tokens: 3 full + tail of 3
    assert first.block_ids == [] and len(h.pin.block_ids) == 4 and bm.num_pinned_blocks == 4
    assert refs(bm) == 4
    bm.unpin(h.pin)
    assert bm.num_pinned_blocks == 0 and refs(bm) == 0 and bm.num_free_blocks == 16
    assert not bm.pinned_tails
    # full blocks stay in the prefix cache after unpinning (evictable again)
    again = Sequence(list(range(10)) + [20, 21, 22, 23, 24, 25], SamplingParams())
    bm.allocate(again, 100)
    assert again.num_computed_tokens == 12


def test_pin_budget_keeps_the_head_that_fits_and_preemption_does_not_pin():
    bm = BlockManager(16, BS)
    bm.max_pinned_blocks = 2
    h = Holder()
    finished(bm, range(14), h)  # 3 full + tail: only the first 2 full blocks fit the budget
    assert len(h.pin.block_ids) == 2 and h.pin.tail_key is False and not bm.pinned_tails
    assert bm.num_pinned_blocks == 2
    h2 = Holder()
    finished(bm, range(100, 110), h2)
    assert h2.pin is None and bm.num_pinned_blocks == 2  # over budget: nothing pinned
    h3 = Holder()
    s = Sequence(list(range(200, 210)), SamplingParams(), request_id="preempted")
    bm.pin_on_finish("preempted", h3)
    bm.allocate(s, 100)
    s.num_computed_tokens = 10
    bm.free(s)  # preempted (no finish_reason): its blocks go back, nothing is pinned
    assert h3.pin is None and bm.num_pinned_blocks == 2


def test_reset_prefix_cache_forgets_tails_and_an_old_managers_pin_is_ignored():
    bm = BlockManager(16, BS)
    h = Holder()
    finished(bm, range(10), h)
    bm.reset_prefix_cache()
    assert not bm.pinned_tails
    s = Sequence(list(range(12)), SamplingParams())
    bm.allocate(s, 100)
    assert s.num_computed_tokens == 0  # stale K/V: nothing served
    other = BlockManager(16, BS)
    other.unpin(h.pin)  # a pin of another (earlier) cache: no effect there
    assert other.num_pinned_blocks == 0 and refs(other) == 0
    bm.unpin(h.pin)
    assert bm.num_pinned_blocks == 0
