"""livemoe.engine.live.LiveSession on tiny random models with the byte-level tokenizer: every decision parses,
the session's blocks stay cached (and pinned) between intervals, compaction keeps the system prompt and
the MEM notes, sessions batch with ordinary requests without changing anyone's tokens."""
import dataclasses

import pytest

from livemoe.engine import LLM, RequestError, SamplingParams
from livemoe.engine.live import KINDS, Decision, parse_decision
from livemoe.engine.live.layout import encode, interval_segment, memory_segment, render_events, system_segment
from livemoe.engine.live.session import LiveSession, step_sessions

pytestmark = pytest.mark.usefixtures("one_thread")
SYSTEM = "you are the live assistant of a shopping stream. link 3: pork zongzi. price: 39 yuan."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tiny_tokenizer import make_text_checkpoint

    path, _ = make_text_checkpoint(tmp_path_factory.mktemp("live") / "m", moe=True, seed=3, max_position_embeddings=2048)
    return path


def _engine(ckpt, **kw):
    kw.setdefault("num_kv_blocks", 128)
    return LLM(ckpt, block_size=16, use_tqdm=False, **kw)


def _session(llm, **kw):
    kw.setdefault("max_message_chars", 48)  # a short token budget per decision, so compaction comes early
    return LiveSession(llm, SYSTEM, **kw)


EVENTS = [[{"type": "join", "user": "amy"}], [], [{"type": "comment", "user": "bob", "text": "price of link 3?"}],
          [{"type": "gift", "user": "amy", "text": "rose"}, {"type": "frame", "text": "the zongzi"}],
          [{"type": "transcript", "text": "now 29 yuan"}], [{"type": "meta", "text": "viewers 9"}],
          [{"type": "comment", "user": "amy", "text": "hi bob"}]]


def _events(n: int) -> list:
    """n intervals of short events (the tiny tokenizer spends a token per byte on most words)."""
    return [EVENTS[i % len(EVENTS)] for i in range(n)]


def test_every_decision_parses_for_50_intervals_with_compaction(ckpt):
    llm = _engine(ckpt)
    s = _session(llm, temperature=1.0, seed=7, max_context=400, keep_intervals=3, max_message_chars=24)
    kinds, compactions = [], 0
    for events in _events(50):
        d = s.step(events)
        assert d.kind in KINDS
        assert parse_decision(d.text) == d  # what the session read is what the text says
        kinds.append(d.kind)
        compactions += d.metrics.compacted
        assert d.metrics.prompt_tokens + d.metrics.completion_tokens <= 400
        assert d.metrics.completion_tokens >= 2 and d.metrics.decode_flops > 0 and d.metrics.latency_s > 0
    assert len(kinds) == 50 and s.num_intervals == 50
    assert compactions >= 2 and s.num_compactions == compactions
    s.close()


@pytest.mark.parametrize("bias", ["O", "M", "A", "\n", "x", "<|im_end|>"])
def test_decisions_parse_whatever_the_weights_push_for(ckpt, bias):
    """A strong logit bias stands for weights that want one token: a kind's first letter (that kind is
    decided), or a token the format has no place for (newline, x, the end token) — it still parses."""
    llm = _engine(ckpt)
    s = _session(llm, temperature=1.0, seed=2)
    tok = llm.tokenizer
    token = tok.convert_tokens_to_ids("Ċ") if bias == "\n" else tok.convert_tokens_to_ids(bias)
    s.params = dataclasses.replace(s.params, logit_bias={token: 30.0})
    kinds = [s.step(e).kind for e in _events(4)]
    assert len(kinds) == 4
    if bias in ("O", "M", "A"):
        assert set(kinds) == {next(k for k in KINDS if k.startswith(bias))}


def test_each_step_prefills_only_the_new_events_and_the_last_decisions_end(ckpt):
    llm = _engine(ckpt, num_kv_blocks=64)
    s = _session(llm, temperature=1.0, seed=1)
    tok = llm.tokenizer
    other = [tok.encode(f"an unrelated prompt number {i} " * 6) for i in range(12)]
    for i, events in enumerate(_events(8)):
        before = len(s.ids)
        d = s.step(events)
        m = d.metrics
        new = encode(tok, interval_segment(render_events(events, (i + 1) * 10.0), after_decision=i > 0))
        assert m.prompt_tokens == before + len(new)
        if i == 0:
            assert m.cached_prompt_tokens < len(s.system_ids)
        else:
            # everything but the new events and the previous decision's end token (sampled, never fed back)
            assert m.cached_prompt_tokens == m.prompt_tokens - len(new) - 1
        # ordinary requests that pass through the whole cache in between do not evict the session
        llm.generate(other, SamplingParams(temperature=0.0, max_tokens=24))
    assert llm.core.block_manager.num_pinned_blocks == len(s.pin.block_ids) > 0
    s.close()  # what an expired session does: its blocks go back
    assert llm.core.block_manager.num_pinned_blocks == 0
    assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks


def test_without_pins_the_cache_is_evicted_and_the_session_reprefills(ckpt):
    llm = _engine(ckpt, num_kv_blocks=64)
    llm.core.block_manager.max_pinned_blocks = 0  # no pin budget: only the evictable prefix cache
    s = _session(llm, temperature=1.0, seed=1)
    tok = llm.tokenizer
    other = [tok.encode(f"an unrelated prompt number {i} " * 6) for i in range(12)]
    s.step(_events(1)[0])
    assert s.pin is None
    llm.generate(other, SamplingParams(temperature=0.0, max_tokens=24))
    d = s.step(_events(2)[1])
    assert d.metrics.cached_prompt_tokens == 0


def test_compaction_keeps_the_system_prompt_and_the_mem_notes(ckpt):
    llm = _engine(ckpt)
    s = _session(llm, temperature=1.0, seed=11, max_context=512, keep_intervals=2)
    tok = llm.tokenizer
    s.params = dataclasses.replace(s.params, logit_bias={tok.convert_tokens_to_ids("M"): 2.0})  # some MEM notes
    notes_at_compaction = None
    for events in _events(40):
        notes = list(s.notes)
        d = s.step(events)
        if d.metrics.compacted and notes:
            notes_at_compaction = notes
            break
    assert notes_at_compaction, "no compaction after a MEM note in 40 intervals"
    # they fitted (none dropped); this step's own decision may have added one
    assert s.notes[:len(notes_at_compaction)] == notes_at_compaction and s.num_dropped_notes == 0
    head = encode(tok, system_segment(SYSTEM)) + encode(tok, memory_segment(notes_at_compaction))
    assert s.ids[:len(head)] == head
    m = d.metrics
    assert m.compaction_tokens == m.prompt_tokens - m.cached_prompt_tokens > 0
    # the system prompt's blocks are still served by the prefix cache
    assert m.cached_prompt_tokens >= len(s.system_ids) // 16 * 16 - 16
    assert m.prompt_tokens < 512 and len(s.records) == s.num_intervals


def test_notes_past_their_budget_drop_oldest_first_and_are_counted(ckpt):
    llm = _engine(ckpt)
    s = _session(llm, temperature=1.0, seed=5, max_context=400, keep_intervals=1)
    tok = llm.tokenizer
    s.params = dataclasses.replace(s.params, logit_bias={tok.convert_tokens_to_ids("M"): 30.0})  # MEM every time
    written = []
    for events in _events(16):
        written.append(s.step(events).message)
    assert s.num_compactions >= 1 and s.num_dropped_notes > 0
    kept_before_last = s.notes[:-1]
    # the kept notes are the newest ones, in order; the dropped ones are the oldest
    assert written[:-1][-len(kept_before_last):] == kept_before_last
    assert s.num_dropped_notes + len(s.notes) == len(written)


def test_two_sessions_and_ordinary_requests_in_one_batch_leave_each_other_unchanged(ckpt):
    events = _events(6)
    prompts = ["the quick brown fox", "a live stream assistant answers"]
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=20)

    def alone():
        llm = _engine(ckpt)
        texts = []
        for seed in (1, 2):
            s = _session(llm, temperature=1.0, seed=seed)
            texts.append([s.step(e).text for e in events])
        return texts, [o.token_ids for o in llm.generate(prompts, params)]

    def together():
        llm = _engine(ckpt)
        a = _session(llm, temperature=1.0, seed=1)
        b = _session(llm, temperature=1.0, seed=2)
        rids = [llm.add_request(p, params) for p in prompts]
        texts = [[], []]
        for e in events:
            da, db = step_sessions(llm, [(a, e), (b, e)])
            texts[0].append(da.text)
            texts[1].append(db.text)
        done = {}
        while len(done) < len(rids):
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        return texts, [done[r] for r in rids]

    t1, o1 = alone()
    t2, o2 = together()
    assert len(t1) == len(t2) == 2 and len(t1[0]) == len(events)
    assert t1 == t2
    assert o1 == o2


def test_bad_events_are_refused_with_the_field_named_and_nothing_changes(ckpt):
    llm = _engine(ckpt)
    s = _session(llm, temperature=0.0)
    for bad, why in [([{"type": "shout", "text": "x"}], r"events\[0\].type must be one of"),
                     ([{"type": "comment", "text": "hi"}], r"events\[0\]: a comment event needs a user"),
                     ([{"type": "comment", "user": "a", "text": "hi", "color": 1}], r"unknown field"),
                     ([{"type": "frame", "text": "a\nb"}], "one line"),
                     ("hello <|im_end|>", "chat markers"), (42, "must be a list")]:
        with pytest.raises(RequestError, match=why):
            s.step(bad)
    assert s.num_intervals == 0 and not llm.core.requests
    d = s.step("comment @amy: hello")
    assert isinstance(d, Decision) and s.num_intervals == 1
    s.close()
    with pytest.raises(RequestError, match="closed"):
        s.step([])
    with pytest.raises(RequestError, match="system"):
        LiveSession(llm, "  ")
    with pytest.raises(RequestError, match="max_context"):
        _session(llm, max_context=10**6)
    with pytest.raises(RequestError, match="max_context must be a positive integer"):
        _session(llm, max_context=0)
