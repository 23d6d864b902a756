"""The synthetic livestream world, its rules, the decision format and the rule judge (livemoe.train.live)."""
import json

import pytest

from livemoe.engine.live.decision import Decision, decision_regex, format_decision, max_decision_chars, parse_decision
from livemoe.engine.errors import DecisionFormatError
from livemoe.train.data import DataError
from livemoe.train.live.data import encode_session, load_sessions, save_sessions
from livemoe.train.live.judge import accuracy, false_claims, room_states, score_interval, score_session
from livemoe.train.live.world import LiveWorldConfig, Referee, decision_text, make_sessions
from livemoe.train.synthetic.world import Product


def test_same_seed_same_sessions_and_other_seed_differs():
    a, b, c = make_sessions(5, seed=3), make_sessions(5, seed=3), make_sessions(5, seed=4)
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(a) != json.dumps(c)


def test_sessions_are_mostly_obs_with_every_decision_present_and_gold_parses():
    sessions = make_sessions(60, seed=0)
    golds = [iv for s in sessions for iv in s["intervals"]]
    assert len(golds) == 60 * LiveWorldConfig().num_intervals
    kinds = [iv["decision"]["kind"] for iv in golds]
    assert kinds.count("OBS") > len(kinds) / 2
    assert {iv["decision"]["task"] for iv in golds if iv["decision"]["kind"] == "ANS"} == {
        "answer", "thank", "welcome", "correct"}
    assert "MEM" in kinds
    for iv in golds:
        d = parse_decision(decision_text(iv))
        assert d.to_json() == iv["decision"]
        # the gold decision is grounded by the judge's own standard
    for s in sessions:
        for iv, st in zip(s["intervals"], room_states(s)):
            sc = score_interval(parse_decision(decision_text(iv)), iv, st)
            assert sc.state and sc.recipient in (None, True) and sc.task in (None, True) and sc.grounding in (None, True)


def _room():
    return {3: Product(3, "pork zongzi", "zongzi", {"filling": "pork", "price": "39 yuan", "stock": "in stock"}),
            7: Product(7, "clear case", "phone case", {"color": "red", "price": "19 yuan", "stock": "in stock"})}


def test_rules_on_hand_made_intervals():
    room = _room()
    r = Referee(room)
    assert r.decide([], join="amy")[0] == {"kind": "ANS", "recipient": "amy", "task": "welcome", "message": "welcome, amy!"}
    assert r.decide([])[0]["kind"] == "OBS"
    r.ask("bob", 3, "price")  # bob asks, the host does not answer
    r.ask("amy", 7, "link")
    room[3].attributes["price"] = "29 yuan"  # the same interval the host announces a new price: MEM first
    d, facts = r.decide([{"link": 3, "attribute": "price", "value": "29 yuan"}], gift=("amy", "rose"))
    assert d == {"kind": "MEM", "recipient": None, "task": None, "message": "link 3 pork zongzi: price is 29 yuan."}
    # the oldest standing question next, with the fact as it is now
    d, facts = r.decide([], gift=("amy", "rose"))
    assert (d["recipient"], d["task"], d["message"]) == ("bob", "answer", "link 3 pork zongzi: price is 29 yuan.")
    d, _ = r.decide([], claim=("carl", 7))
    assert (d["recipient"], d["task"], d["message"]) == ("amy", "answer", "the clear case is link 7.")
    d, _ = r.decide([], claim=("carl", 7), gift=("amy", "rose"))
    assert (d["recipient"], d["task"], d["message"]) == ("carl", "correct", "not quite. link 7 clear case: price is 19 yuan.")
    d, facts = r.decide([], gift=("amy", "rose"), join="dina")
    assert (d["recipient"], d["task"], facts) == ("amy", "thank", ["amy", "rose"])


@pytest.mark.parametrize("text,expected", [
    ("OBS", Decision("OBS")),
    (" MEM link 3 pork zongzi: price is 29 yuan.\n", Decision("MEM", message="link 3 pork zongzi: price is 29 yuan.")),
    ("ANS @amy_2 thank: thank you for the rose, amy!", Decision("ANS", "amy_2", "thank", "thank you for the rose, amy!")),
])
def test_parse_and_format_round_trip(text, expected):
    d = parse_decision(text)
    assert d == expected
    assert parse_decision(d.text) == d
    assert format_decision(d.kind, d.recipient, d.task, d.message) == d.text


@pytest.mark.parametrize("text,why", [
    ("obs", "not a decision"), ("OBS now", "not a decision"), ("MEM ", "not a decision"), ("MEM  ", "not a decision"),
    ("ANS amy answer: hi", "not a decision"), ("ANS @amy dance: hi", "task 'dance'"), ("ANS @amy answer: ", "not a decision"),
    ("MEM a\nb", "one-line"), ("", "not a decision"),
])
def test_parse_refuses_malformed_text(text, why):
    with pytest.raises(DecisionFormatError, match=why):
        parse_decision(text)


def test_regex_accepts_exactly_what_the_parser_reads():
    import re
    rx = re.compile(decision_regex())
    for s in make_sessions(5, seed=1):
        for iv in s["intervals"]:
            assert rx.fullmatch(decision_text(iv))
    for bad in ("OBS ", "ANS @amy dance: hi", "MEM " + "x" * 161, "ANS @ answer: hi"):
        assert not rx.fullmatch(bad)
    assert len("ANS @" + "a" * 24 + " welcome: " + "x" * 160) == max_decision_chars()


def test_judge_on_crafted_good_and_bad_decisions():
    s = make_sessions(1, seed=0)[0]
    iv = {"decision": {"kind": "ANS", "recipient": "bob", "task": "answer", "message": "link 3 pork zongzi: price is 29 yuan."},
          "facts": ["link 3 pork zongzi: price is 29 yuan."]}
    state = {3: {"name": "pork zongzi", "price": "29 yuan"}}
    good = score_interval(Decision("ANS", "bob", "answer", "hi bob. link 3 pork zongzi: price is 29 yuan."), iv, state)
    assert (good.state, good.recipient, good.task, good.grounding) == (True, True, True, True)
    assert good.reward() == pytest.approx(1.0)
    stale = score_interval(Decision("ANS", "bob", "answer", "link 3 pork zongzi: price is 39 yuan."), iv, state)
    assert (stale.state, stale.recipient, stale.task, stale.grounding) == (True, True, True, False)
    # the right fact plus a false one is not grounded
    extra = score_interval(Decision("ANS", "bob", "answer",
                                    "link 3 pork zongzi: price is 29 yuan. link 3 pork zongzi: stock is sold out."), iv, state)
    assert extra.grounding is False
    wrong_who = score_interval(Decision("ANS", "amy", "answer", "link 3 pork zongzi: price is 29 yuan."), iv, state)
    assert (wrong_who.recipient, wrong_who.task) == (False, True)
    wrong_task = score_interval(Decision("ANS", "bob", "thank", "link 3 pork zongzi: price is 29 yuan."), iv, state)
    assert (wrong_task.recipient, wrong_task.task) == (True, False)
    silent = score_interval(Decision("OBS"), iv, state)
    assert (silent.state, silent.recipient, silent.task, silent.grounding) == (False, False, False, False)
    assert silent.reward() == 0.0
    unparsed = score_interval(None, iv, state)
    assert unparsed == silent
    obs_iv = {"decision": {"kind": "OBS", "recipient": None, "task": None, "message": None}}
    assert score_interval(Decision("OBS"), obs_iv).reward() == pytest.approx(1.0)
    assert score_interval(Decision("MEM", message="x"), obs_iv).state is False
    assert false_claims("link 3 pork zongzi: price is 1.5 hp. ok", state) == ["link 3 pork zongzi: price is 1.5 hp."]
    assert false_claims("link 9 tea: price is 1 yuan.", state)  # no such link

    gold = [parse_decision(decision_text(x)) for x in s["intervals"]]
    perfect = score_session(gold, s)
    assert accuracy(perfect.intervals)["state"] == 100.0 and perfect.spam == perfect.contradictions == 0
    assert perfect.trajectory_reward(len(gold)) == pytest.approx(1.0)
    # answering everyone all the time: spam on every gold-OBS interval
    spammy = [Decision("ANS", "amy", "answer", "hi") for _ in gold]
    sc = score_session(spammy, s)
    assert sc.spam == sum(x["decision"]["kind"] == "OBS" for x in s["intervals"]) > 0
    assert sc.trajectory_reward(len(gold)) < perfect.trajectory_reward(len(gold))
    with pytest.raises(ValueError, match="2 decisions for a session of"):
        score_session(gold[:2], s)


def test_recordings_leave_out_courtesy_replies_on_their_own_random_stream():
    noisy = make_sessions(40, seed=5)
    clean = make_sessions(40, seed=5, cfg=LiveWorldConfig(p_unrecorded_courtesy=0.0))

    def reviewed(sessions):
        return [[{k: v for k, v in iv.items() if k != "recorded"} for iv in s["intervals"]] for s in sessions]

    assert reviewed(noisy) == reviewed(clean)  # events and reviewed decisions do not depend on the recording
    assert json.dumps(make_sessions(40, seed=5)) == json.dumps(noisy)
    assert not any("recorded" in iv for s in clean for iv in s["intervals"])
    ivs = [iv for s in noisy for iv in s["intervals"]]
    recorded = [iv for iv in ivs if "recorded" in iv]
    courtesy = [iv for iv in ivs if iv["decision"]["task"] in ("welcome", "thank")]
    assert recorded and courtesy
    assert 0.3 < len(recorded) / len(courtesy) < 0.7  # p_unrecorded_courtesy 0.5
    for iv in recorded:
        assert iv["decision"]["task"] in ("welcome", "thank")
        assert decision_text(iv, recorded=True) == "OBS" and decision_text(iv).startswith("ANS @")
    assert all(decision_text(iv, recorded=True) == decision_text(iv) for iv in ivs if "recorded" not in iv)
    with pytest.raises(ValueError, match="p_unrecorded_courtesy must be in"):
        LiveWorldConfig(p_unrecorded_courtesy=1.5)


def test_jsonl_round_trip_and_bad_lines_named(tmp_path):
    sessions = make_sessions(3, seed=2)
    path = tmp_path / "s.jsonl"
    save_sessions(sessions, path)
    assert load_sessions(str(path)) == sessions
    bad = dict(sessions[0])
    bad["intervals"] = [dict(bad["intervals"][0], decision={"kind": "ANS", "recipient": "amy", "task": "dance",
                                                              "message": "x"})]
    path.write_text(json.dumps(sessions[1]) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"s.jsonl:2 intervals\[0\]: decision: task 'dance'"):
        load_sessions(str(path))
    path.write_text(json.dumps(dict(sessions[0], intervals=[{"events": [{"type": "shout"}], "decision": {"kind": "OBS"}}])))
    with pytest.raises(DataError, match=r"s.jsonl:1 intervals\[0\]: events\[0\].type must be one of"):
        load_sessions(str(path))
    for recorded, why in (("OBS", "recorded must be a decision object"),
                          ({"kind": "ANS", "recipient": "amy", "task": "dance", "message": "x"}, "recorded: task 'dance'")):
        path.write_text(json.dumps(dict(sessions[0], intervals=[dict(sessions[0]["intervals"][0], recorded=recorded)])))
        with pytest.raises(DataError, match=rf"s.jsonl:1 intervals\[0\]: {why}"):
            load_sessions(str(path))
    path.write_text("{not json\n")
    with pytest.raises(DataError, match=r"s.jsonl:1: not valid JSON"):
        load_sessions(str(path))


def test_encoded_session_spans_hold_each_decision_and_the_end_token():
    from tiny_tokenizer import train_tokenizer

    tok = train_tokenizer()
    s = make_sessions(1, seed=0)[0]
    enc = encode_session(s, tok, eos_id=2)
    assert len(enc.decision_spans) == len(s["intervals"]) > 0
    for (a, b), iv in zip(enc.decision_spans, s["intervals"]):
        assert enc.input_ids[b - 1] == 2
        assert tok.decode(enc.input_ids[a:b - 1]) == decision_text(iv)
    # the recorded trajectory's decisions instead, where it left a courtesy reply out
    s = next(x for x in make_sessions(20, seed=0) if any("recorded" in iv for iv in x["intervals"]))
    enc = encode_session(s, tok, eos_id=2, recorded=True)
    assert len(enc.decision_spans) == len(s["intervals"])
    for (a, b), iv, kind in zip(enc.decision_spans, s["intervals"], enc.kinds):
        want = iv.get("recorded", iv["decision"])
        assert tok.decode(enc.input_ids[a:b - 1]) == decision_text(iv, recorded=True)
        assert kind == want["kind"]


def test_accuracy_reports_binomial_standard_errors_and_counts():
    from livemoe.train.live.judge import IntervalScore

    # 4 intervals: 3 states right; 2 gold ANS with 1 recipient right, 2 tasks right; 3 graded groundings, 1 right
    scores = [IntervalScore(True, True, True, False), IntervalScore(True, False, True, None),
              IntervalScore(True, None, None, True), IntervalScore(False, None, None, False)]
    acc = accuracy(scores)
    assert (acc["state"], acc["state_n"]) == (75.0, 4)
    assert acc["state_se"] == pytest.approx(100 * (0.75 * 0.25 / 4) ** 0.5)
    assert (acc["recipient"], acc["recipient_n"], acc["recipient_se"]) == (50.0, 2, pytest.approx(100 * 0.5 / 2 ** 0.5))
    assert (acc["task"], acc["task_se"]) == (100.0, 0.0)  # all right: no spread
    assert acc["grounding"] == pytest.approx(100 / 3) and acc["grounding_n"] == 3
    assert accuracy([])["recipient_se"] == 0.0 and accuracy([])["recipient_n"] == 0


def test_paired_margin_of_two_stages_on_the_same_intervals():
    from livemoe.train.live.trainer import format_margins
    from livemoe.train.live.judge import IntervalScore, outcomes, paired_margin

    # 5 intervals: after fixes #2 and #4, breaks #5 -> differences 0, 1, 0, 1, -1: mean .2, sample var .7
    before, after = [1, 0, 1, 0, 1], [1, 1, 1, 1, 0]
    m, se = paired_margin(before, after)
    assert m == pytest.approx(20.0) and se == pytest.approx(100 * (0.7 / 5) ** 0.5)
    assert paired_margin([1, 0], [1, 0]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same non-zero length"):
        paired_margin([1], [1, 0])
    scores = [IntervalScore(True, True, False, True), IntervalScore(False, None, None, None),
              IntervalScore(True, False, True, False)]
    assert outcomes(scores) == {"state": [1, 0, 1], "recipient": [1, 0], "task": [0, 1]}
    rows = {"a": {"outcomes": {"state": before, "recipient": [0, 0], "task": [1, 1]}},
            "b": {"outcomes": {"state": after, "recipient": [1, 1], "task": [1, 0]}}}
    table = format_margins(rows)
    assert "| b vs a | +20.00 ± 37.42 | +100.00 ± 0.00 | -50.00 ± 50.00 |" in table
