"""Scheduler: token budget, chunked prefill mixed with decodes, max_num_seqs, preemption by recompute."""
from livemoe.engine.decoder.block_manager import BlockManager
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.decoder.scheduler import Scheduler
from livemoe.engine.decoder.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=64, max_num_seqs=8, max_tokens=16):
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, max_tokens)


def seq(n, start=0):
    return Sequence(list(range(start, start + n)), SamplingParams())


def step(sched, fake_token=1):
    """Runs one step with a fake model: every seq that reaches its end samples fake_token."""
    out = sched.schedule()
    sampled = sched.update_computed(out)
    for s, did in zip(out.seqs, sampled):
        if did:
            s.append_token(fake_token)
    return out


def test_long_prompt_is_chunked_and_decodes_keep_running():
    sched = make(max_tokens=8)
    a = seq(3)
    sched.add(a)
    out = step(sched)
    assert out.num_new_tokens == [3] and len(a) == 4  # a prefilled and sampled
    b = seq(20, start=100)
    sched.add(b)
    out = step(sched)
    # a decodes (1 token) and b gets the rest of the budget as its first chunk
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 7]
    assert len(b) == 20  # b did not sample mid-prompt
    out = step(sched)
    assert out.num_new_tokens == [1, 7]
    out = step(sched)
    assert out.num_new_tokens == [1, 6] and len(b) == 21  # b's last chunk sampled
    out = step(sched)
    assert out.num_new_tokens == [1, 1] and out.is_decode_only


def test_max_num_seqs():
    sched = make(max_num_seqs=2, max_tokens=100)
    seqs = [seq(3, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = step(sched)
    assert out.seqs == seqs[:2] and len(sched.waiting) == 1


def test_budget_limits_decodes():
    sched = make(max_tokens=2)
    seqs = [seq(1, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert step(sched).seqs == seqs[:2]
    out = step(sched)
    assert out.seqs == seqs[:2]  # running seqs first; the third still waits for budget
    assert seqs[2].status == SequenceStatus.WAITING


def test_preemption_when_blocks_run_out_and_recompute():
    sched = make(num_blocks=4, max_tokens=64)
    a, b = seq(4, start=0), seq(4, start=50)
    sched.add(a)
    sched.add(b)
    step(sched)  # 4 prompt tokens: one block each
    assert len(a.block_table) == 1 and len(b.block_table) == 1
    # decode until blocks run out: each seq needs a new block every 4 tokens
    for _ in range(4):
        step(sched)
    out = step(sched)
    assert sched.num_preemptions >= 1 and b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and out.seqs == [a]
    # b comes back once a finishes, recomputing its prompt and generated tokens together
    sched.finish(a)
    assert sched.block_manager.num_free_blocks == 4
    n_before = len(b)
    out = step(sched)
    # its full blocks were freed with their hashes: the recompute hits them (counted apart)
    bm = sched.block_manager
    assert bm.stats.recompute_hits > 0 and bm.stats.recompute_hits % BS == 0
    assert out.seqs == [b] and out.num_new_tokens == [n_before - bm.stats.recompute_hits]
    assert len(b) == n_before + 1


def test_abort_frees_blocks():
    sched = make()
    a, b = seq(9), seq(5, start=40)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.finish(a)
    assert a.status == SequenceStatus.FINISHED and a not in sched.running
    sched.finish(b)
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished()


def req_seq(request_id, n=3, start=0):
    s = Sequence(list(range(start, start + n)), SamplingParams(), request_id)
    return s


def test_fair_share_seats_a_small_request_behind_a_large_one():
    """Request "big" (12 seqs) fills all 4 seats; "small" arrives behind 8 of big's waiting seqs. With a
    share of 2, small is seated at the next step (a big seq is preempted for it) instead of waiting for
    two waves of big; alone, big used every seat; and nothing is lost (each seq still runs to its end)."""
    sched = Scheduler(BlockManager(64, BS), 4, 64, max_running_seqs_per_request=2)
    big = [req_seq("big", start=10 * i) for i in range(12)]
    for s in big:
        sched.add(s)
    step(sched)
    assert [s.request_id for s in sched.running] == ["big"] * 4  # alone: every seat, not just its share
    small = req_seq("small", start=500)
    sched.add(small)
    out = step(sched)
    assert small in out.seqs and small.status == SequenceStatus.RUNNING
    assert sum(s.request_id == "big" for s in sched.running) == 3 and sched.num_preemptions == 1
    # the preempted big seq waits at the front, but the share keeps it from taking small's seat back
    preempted = [s for s in big if s.num_preemptions]
    assert len(preempted) == 1 and sched.waiting[0] is preempted[0]
    step(sched)
    assert small.status == SequenceStatus.RUNNING and sched.num_preemptions == 1  # no thrash


def test_fair_share_off_is_first_come_first_served():
    sched = Scheduler(BlockManager(64, BS), 4, 64)  # no share given: the whole batch
    for i in range(12):
        sched.add(req_seq("big", start=10 * i))
    step(sched)
    small = req_seq("small", start=500)
    sched.add(small)
    step(sched)
    assert small.status == SequenceStatus.WAITING and sched.num_preemptions == 0
