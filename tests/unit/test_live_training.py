"""MA-MSFT weights and class balancing against a plain PyTorch computation; SM-GSPO's rewards,
advantages and per-turn sequence-level ratios on hand-computed cases; a few steps of each."""
import math

import pytest
import torch
import torch.nn.functional as F

from livemoe.engine import load_model, load_tokenizer
from livemoe.engine.live.decision import format_decision
from livemoe.train.live.data import encode_session
from livemoe.train.live.gspo import (GSPOOptions, decision_class, part_advantages, part_rewards, part_starts, per_turn_policy_loss,
                             rewards_of, split_tokens, split_turns, turn_rows)
from livemoe.train.live.msft import MSFTOptions, class_weights, encode_example, train_msft
from livemoe.train.live.world import LiveWorldConfig, make_sessions
from livemoe.train.sft import collate, sft_step_loss
from livemoe.train.rollout import Completion

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_tokenizer import make_text_checkpoint

    path, _ = make_text_checkpoint(tmp_path_factory.mktemp("livetrain") / "m", moe=True, seed=1,
                                   max_position_embeddings=2048)
    return path


def test_class_weights_balance_kinds():
    kinds = ["OBS"] * 6 + ["ANS"] * 3 + ["MEM"]
    w = class_weights(kinds, 1.0)
    assert w == pytest.approx({"OBS": 10 / 18, "ANS": 10 / 9, "MEM": 10 / 3})
    # balanced: each kind's intervals weigh the same in total
    assert 6 * w["OBS"] == pytest.approx(3 * w["ANS"]) == pytest.approx(1 * w["MEM"])
    assert class_weights(kinds, 0.0) == {"OBS": 1.0, "ANS": 1.0, "MEM": 1.0}
    assert class_weights(kinds, 0.5)["MEM"] == pytest.approx(math.sqrt(10 / 3))


def _plain_weights(tokenizer, session, by_kind, marker_weight, eos, recipient_weight):
    """Per target position, computed from scratch: each decision token's characters decoded one token
    at a time; a token starting in the recipient name weighs recipient_weight, another token starting
    before the message (or the end token) marker_weight. The decisions are the recorded trajectory's."""
    enc = encode_session(session, tokenizer, eos, recorded=True)
    w = torch.zeros(len(enc.input_ids) - 1)
    for (a, b), iv in zip(enc.decision_spans, session["intervals"]):
        d = iv.get("recorded", iv["decision"])
        text = format_decision(d["kind"], d.get("recipient"), d.get("task"), d.get("message"))
        message_at = len(text) - len(d["message"]) if d["kind"] != "OBS" else len(text)
        name = range(len("ANS @"), len("ANS @") + len(d["recipient"])) if d["kind"] == "ANS" else range(0)
        pos = 0
        for j, tok in enumerate(enc.input_ids[a:b]):
            marker = tok == eos or pos < message_at
            weight = recipient_weight if tok != eos and pos in name else marker_weight if marker else 1.0
            w[a + j - 1] = weight * by_kind[d["kind"]]
            pos += len(tokenizer.decode([tok]))
    return enc.input_ids, w


def test_msft_weights_and_loss_match_plain_pytorch(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny)
    sessions = make_sessions(3, seed=4, cfg=LiveWorldConfig(num_intervals=5))
    kinds = [iv.get("recorded", iv["decision"])["kind"] for s in sessions for iv in s["intervals"]]
    by_kind = class_weights(kinds, 1.0)
    assert any(iv["decision"]["kind"] == "ANS" for s in sessions for iv in s["intervals"])
    # a courtesy reply the recording left out: MA-MSFT learns the recorded OBS there
    assert any("recorded" in iv for s in sessions for iv in s["intervals"])
    examples, expected = [], []
    for s in sessions:
        e = encode_example(s, tok, tok.eos_token_id, by_kind, 3.0, max_len=10**6, recipient_weight=7.0)
        ids, w = _plain_weights(tok, s, by_kind, 3.0, tok.eos_token_id, 7.0)
        assert e["input_ids"] == ids
        assert torch.tensor(e["weights"]) == pytest.approx(w)
        assert set(w.unique().tolist()) >= {0.0}
        # without a recipient weight the name weighs as the other fields do (the old MA-MSFT)
        same = encode_example(s, tok, tok.eos_token_id, by_kind, 3.0, max_len=10**6)
        assert torch.tensor(same["weights"]) == pytest.approx(_plain_weights(tok, s, by_kind, 3.0, tok.eos_token_id, 3.0)[1])
        examples.append(e)
        expected.append((ids, w))
    # some recipient tokens are weighted
    assert any(torch.isclose(w, torch.tensor(7.0 * by_kind["ANS"])).any() for _, w in expected)
    batch = collate(examples, tok.pad_token_id, torch.device("cpu"))
    normalizer = batch["weights"][batch["targets"] != -100].sum()
    _, loss, _ = sft_step_loss(model, batch, normalizer, 0.0, 1, torch.autocast("cpu", enabled=False))
    num = den = 0.0
    with torch.no_grad():
        for ids, w in expected:
            x = torch.tensor([ids])
            hidden = model.forward_hidden(x)
            logits = hidden[0, :-1].float() @ model.lm_head_weight.float().T
            nll = F.cross_entropy(logits, x[0, 1:], reduction="none")
            num, den = num + (w * nll).sum(), den + w.sum()
    assert float(loss) == pytest.approx(float(num / den), rel=1e-4)


def test_msft_cuts_sessions_to_whole_intervals_within_max_len(tiny):
    tok = load_tokenizer(tiny)
    s = make_sessions(1, seed=0, cfg=LiveWorldConfig(num_intervals=6))[0]
    enc = encode_session(s, tok, tok.eos_token_id)
    cut = enc.decision_spans[2][1] + 3  # room for three whole intervals and part of the fourth
    e = encode_example(s, tok, tok.eos_token_id, {"OBS": 1.0, "MEM": 1.0, "ANS": 1.0}, 1.0, cut)
    assert e["input_ids"] == enc.input_ids[:enc.decision_spans[2][1]]
    assert encode_example(s, tok, tok.eos_token_id, {"OBS": 1, "MEM": 1, "ANS": 1}, 1.0, 5) is None


def test_a_few_msft_steps_lower_the_loss(tiny):
    tok, model = load_tokenizer(tiny), load_model(tiny)
    sessions = make_sessions(4, seed=1, cfg=LiveWorldConfig(num_intervals=3))
    out = train_msft(model, tok, sessions, MSFTOptions(steps=8, batch_size=2, lr=1e-2, warmup_steps=0),
                     log=lambda m: None)
    losses = [h["loss"] for h in out["history"]]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def _comp(turn_texts):
    return Completion([], [], [], turn_texts[-1], "stop", turn_spans=[(0, 1)] * len(turn_texts),
                      turn_texts=list(turn_texts))


def test_gspo_rewards_and_advantages_on_hand_computed_cases():
    from livemoe.train.advantages import multi_turn_advantages

    session = {"intervals": [
        {"decision": {"kind": "ANS", "recipient": "amy", "task": "welcome", "message": "welcome, amy!"},
         "facts": ["amy"], "questions": []},
        {"decision": {"kind": "OBS", "recipient": None, "task": None, "message": None}, "facts": []}]}
    good = _comp(["ANS @amy welcome: welcome, amy!", "OBS"])
    wrong_who = _comp(["ANS @bob welcome: welcome, amy!", "OBS"])  # state, task and grounding right, recipient wrong
    spam = _comp(["OBS", "ANS @amy thank: hi"])  # both turns wrong; the second is spam
    opts = GSPOOptions()
    turns, traj = rewards_of([session], [[good, wrong_who, spam]], opts)
    assert turns == [pytest.approx([1.0, 1.0]), pytest.approx([0.8, 1.0]), pytest.approx([0.0, 0.0])]
    assert traj == pytest.approx([1.0, 1.0, 0.5])  # no questions: 1, minus spam 1 / 2 intervals
    adv = multi_turn_advantages(turns, 3, 0.5, trajectory_rewards=traj)
    # turn 1: rewards 1, .8, 0 -> mean .6, std .5292; turn 2: 1, 1, 0 -> mean .6667, std .5774;
    # trajectory: 1, 1, .5 -> mean .8333, std .2887
    t1 = [(1 - 0.6) / 0.52915, (0.8 - 0.6) / 0.52915, (0 - 0.6) / 0.52915]
    t2 = [(1 - 0.66667) / 0.57735] * 2 + [(0 - 0.66667) / 0.57735]
    tr = [(1 - 0.83333) / 0.28868] * 2 + [(0.5 - 0.83333) / 0.28868]
    for i in range(3):
        assert adv[i] == pytest.approx([0.5 * t1[i] + 0.5 * tr[i], 0.5 * t2[i] + 0.5 * tr[i]], abs=1e-3)


def _comps(tok, texts):
    comps = []
    for tt in texts:
        ids, spans = [], []
        for t in tt:
            enc = tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            spans.append((len(ids), len(ids) + len(enc)))
            ids += enc
        comps.append(Completion([], ids, [0.0] * len(ids), tt[-1], "stop", turn_spans=spans, turn_texts=tt))
    return comps


WELCOME_SESSION = {"intervals": [
    {"decision": {"kind": "ANS", "recipient": "amy", "task": "welcome", "message": "welcome, amy!"},
     "facts": ["amy"], "questions": []},
    {"decision": {"kind": "OBS", "recipient": None, "task": None, "message": None}, "facts": []}]}


def test_head_credit_splits_head_and_body_with_their_own_rewards(tiny):
    tok = load_tokenizer(tiny)
    texts = [["ANS @amy welcome: welcome, amy!", "OBS"],
             ["ANS @bob welcome: welcome, amy!", "OBS"],  # only the recipient wrong
             ["ANS @amy welcome: hello", "OBS"]]  # only the message wrong (not grounded)
    comps = _comps(tok, texts)
    scores = []
    opts = GSPOOptions(num_generations=3, turn_weight=1.0, credit="head")
    _, traj = rewards_of([WELCOME_SESSION], [comps], opts, scores)
    parts = [[part_rewards(x, (0.4, 0.2, 0.2, 0.2)) for x in t] for t in scores]
    # head: (.4 state + .2 recipient + .2 task) / .8; body: grounding (OBS: the state)
    assert [(p["head"], p["body"]) for t in parts for p in t] == [
        pytest.approx(x) for x in [(1.0, 1.0), (1.0, 1.0), (0.75, 1.0), (1.0, 1.0), (1.0, 0.0), (1.0, 1.0)]]
    advs = part_advantages(scores, traj, opts)
    # heads 1, .75, 1 -> mean .9167, std .1443: the wrong recipient alone is pushed down
    assert [a[0]["head"] for a in advs] == pytest.approx([0.5774, -1.1547, 0.5774], abs=1e-3)
    # bodies 1, 1, 0: the ungrounded message alone is pushed down, its right recipient is not
    assert [a[0]["body"] for a in advs] == pytest.approx([0.5774, 0.5774, -1.1547], abs=1e-3)
    spans, got = split_turns(tok, comps[1], advs[1], "head")
    offsets = tok(texts[1][0], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    head_len = sum(a < len("ANS @bob welcome: ") for a, _ in offsets)  # the tokens that start in the head
    ans_len = len(offsets) + 1  # the end token goes with the message
    assert 0 < head_len < len(offsets)
    # ANS: head and body (the end token in the body); OBS: all head, its end token too
    assert spans == [(0, head_len), (head_len, ans_len), (ans_len, ans_len + 4)]
    assert got == pytest.approx([advs[1][0]["head"], advs[1][0]["body"], advs[1][1]["head"]])


def test_field_credit_moves_each_field_by_its_own_score(tiny):
    tok = load_tokenizer(tiny)
    texts = [["ANS @amy welcome: welcome, amy!", "OBS"],
             ["ANS @amyx welcome: welcome, amy!", "OBS"],  # only the recipient wrong (a name one letter long)
             ["ANS @amy thank: welcome, amy!", "OBS"],  # only the task wrong
             ["OBS", "ANS @amy thank: hi"]]  # both states wrong
    comps = _comps(tok, texts)
    scores = []
    opts = GSPOOptions(num_generations=4, turn_weight=1.0, credit="field")
    _, traj = rewards_of([WELCOME_SESSION], [comps], opts, scores)
    advs = part_advantages(scores, traj, opts)
    first = [a[0] for a in advs]
    # state 1, 1, 1, 0 -> mean .75, std .5: only the OBS is pushed down, the three ANS markers alike up
    assert [a["state"] for a in first] == pytest.approx([0.5, 0.5, 0.5, -1.5], abs=1e-3)
    # recipient 1, 0, 1, 0 (the OBS has none: wrong, as its state): the name "amyx" down, "amy" up
    assert [a["recipient"] for a in first] == pytest.approx([0.866, -0.866, 0.866, -0.866], abs=1e-3)
    # task 1, 1, 0, 0; grounding 1, 1, 1, 0: the wrong task does not touch its grounded message
    assert [a["task"] for a in first] == pytest.approx([0.866, 0.866, -0.866, -0.866], abs=1e-3)
    assert [a["grounding"] for a in first] == pytest.approx([0.5, 0.5, 0.5, -1.5], abs=1e-3)
    text = texts[1][0]
    spans, got = split_turns(tok, comps[1], advs[1], "field")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    starts, pos = [], 0
    for t in ids:
        starts.append(pos)
        pos += len(tok.decode([t]))
    assert pos == len(text)

    def count(a, b):  # tokens that start in [a, b)
        return sum(a <= x < b for x in starts)

    bounds = [0, 5, text.index(" welcome"), text.index(": ") + 1, len(text) + 1]
    n = [count(a, b) for a, b in zip(bounds, bounds[1:])]
    assert len(n) == 4 and all(x > 0 for x in n) and sum(n) == len(ids)
    n[-1] += 1  # the end token goes with the message
    ends = [sum(n[:i + 1]) for i in range(4)]
    assert spans[:4] == list(zip([0] + ends[:3], ends))
    assert got[:4] == pytest.approx([advs[1][0][f] for f in ("state", "recipient", "task", "grounding")])
    assert got[1] < 0 < got[0] and got[2] > 0  # the wrong name alone is pushed down
    assert spans[4:] == [(ends[3], ends[3] + 4)] and got[4] == pytest.approx(advs[1][1]["state"])  # OBS: one part


def test_credit_modes_cover_every_token_and_bad_credit_is_refused(tiny):
    tok = load_tokenizer(tiny)
    for text in ("ANS @amy answer: link 3 tea: price is 9 yuan.", "MEM link 3 tea: price is 9 yuan.", "OBS",
                 "ANS @amy"):  # the last cut short by the token budget
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for credit in ("turn", "head", "field"):
            parts = split_tokens(tok, ids, part_starts(text, credit))
            assert len(parts) > 0 and sum(n for n, _ in parts) == len(ids), (text, credit, parts)
        assert [name for _, name in split_tokens(tok, ids, part_starts(text, "turn"))] == ["turn"]
    assert [x for _, x in part_starts("ANS @amy answer: hi", "field")] == ["state", "recipient", "task", "grounding"]
    assert [x for _, x in part_starts("MEM link 3 tea: price is 9 yuan.", "field")] == ["state", "grounding"]
    with pytest.raises(ValueError, match="credit must be one of"):
        GSPOOptions(credit="token")


def test_balance_scales_each_interval_by_its_gold_class(tiny):
    tok = load_tokenizer(tiny)
    comps = _comps(tok, [["ANS @amy welcome: welcome, amy!", "OBS"], ["OBS", "ANS @amy thank: hi"]])
    assert [decision_class(iv) for iv in WELCOME_SESSION["intervals"]] == ["ANS welcome", "OBS"]
    scores = []
    opts = GSPOOptions(num_generations=2, turn_weight=1.0, credit="turn")
    _, traj = rewards_of([WELCOME_SESSION], [comps], opts, scores)
    plain = part_advantages(scores, traj, opts)
    weighted = part_advantages(scores, traj, opts, [[3.0, 0.5], [3.0, 0.5]])
    assert [a["turn"] for t in plain for a in t] == pytest.approx([0.7071, 0.7071, -0.7071, -0.7071], abs=1e-3)
    assert [a["turn"] for t in weighted for a in t] == pytest.approx([2.1213, 0.3536, -2.1213, -0.3536], abs=1e-3)
    # the weights of train_gspo: N / (K n_class) ** balance over the training intervals, MA-MSFT's formula
    w = class_weights([decision_class(iv) for iv in WELCOME_SESSION["intervals"] * 3 + [WELCOME_SESSION["intervals"][1]]], 1.0)
    assert w == pytest.approx({"ANS welcome": 7 / (2 * 3), "OBS": 7 / (2 * 4)})
    with pytest.raises(ValueError, match="balance must be in"):
        GSPOOptions(balance=1.5)


def test_scale_rewards_none_only_centres_each_intervals_rewards(tiny):
    tok = load_tokenizer(tiny)
    comps = _comps(tok, [["ANS @amy welcome: welcome, amy!", "OBS"], ["OBS", "ANS @amy thank: hi"]])
    scores = []
    opts = GSPOOptions(num_generations=2, turn_weight=1.0, credit="turn", scale_rewards="none")
    rewards, traj = rewards_of([WELCOME_SESSION], [comps], opts, scores)
    centred = part_advantages(scores, traj, opts)
    assert len(rewards) == len(centred) == 2 and all(len(r) == 2 for r in rewards)
    for t in range(2):
        mean = (rewards[0][t] + rewards[1][t]) / 2
        assert rewards[0][t] != rewards[1][t]  # each interval has a spread to centre
        assert [centred[i][t]["turn"] for i in range(2)] == pytest.approx([rewards[i][t] - mean for i in range(2)])
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        GSPOOptions(scale_rewards="std")


def test_per_turn_sequence_ratios_match_plain_pytorch():
    torch.manual_seed(0)
    T = 9
    # two trajectories; trajectory 0 has turns at [1, 4) and [5, 7), trajectory 1 one turn at [2, 8)
    turn_ids = torch.zeros(2, T, dtype=torch.long)
    turn_ids[0, 1:4], turn_ids[0, 5:7], turn_ids[1, 2:8] = 1, 2, 1
    batch = {"completion_mask": (turn_ids > 0).float()}
    traj, mask = turn_rows(batch, turn_ids, [2, 1])
    assert traj.tolist() == [0, 0, 1] and mask.sum(1).tolist() == [3.0, 2.0, 6.0]
    old = torch.randn(2, T)
    lp = (old + 0.01 * torch.randn(2, T)).requires_grad_()
    adv = torch.zeros(2, T)
    adv[0, 1:4], adv[0, 5:7], adv[1, 2:8] = 1.5, -0.5, 0.7
    opts = GSPOOptions(epsilon_low=0.002, epsilon_high=0.003)
    loss, _ = per_turn_policy_loss(lp, old, adv, traj, mask, opts)
    expected = []
    for i, (a, b), A in ((0, (1, 4), 1.5), (0, (5, 7), -0.5), (1, (2, 8), 0.7)):
        r = torch.exp((lp[i, a:b] - old[i, a:b]).mean())
        expected.append(-torch.min(r * A, r.clamp(1 - 0.002, 1 + 0.003) * A))
    ref = torch.stack(expected).mean()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    g1, = torch.autograd.grad(loss, lp)
    g2, = torch.autograd.grad(ref, lp)
    assert torch.allclose(g1, g2, atol=1e-6)
    # one pass (num_iterations 1) skips the old log-probs: on-policy, the same loss and gradient as with
    # old = the current values, which differ from the off-policy ones above
    on, _ = per_turn_policy_loss(lp, None, adv, traj, mask, opts)
    same, _ = per_turn_policy_loss(lp, lp.detach(), adv, traj, mask, opts)
    assert float(on.detach()) == pytest.approx(float(same.detach()), rel=1e-6)
    g_on, = torch.autograd.grad(on, lp)
    g_same, = torch.autograd.grad(same, lp)
    assert torch.allclose(g_on, g_same, atol=1e-7) and not torch.allclose(g_on, g1, atol=1e-6)


def test_a_few_sm_gspo_steps_play_parse_and_update(tiny):
    from livemoe.train.live.gspo import train_gspo

    tok, model = load_tokenizer(tiny), load_model(tiny)
    sessions = make_sessions(3, seed=2, cfg=LiveWorldConfig(num_intervals=3))
    before = [p.detach().clone() for p in model.parameters()]
    opts = GSPOOptions(steps=2, sessions_per_step=1, num_generations=2, num_iterations=2, max_message_chars=24,
                       lr=1e-3)
    out = train_gspo(model, tok, sessions, opts, log=lambda m: None, num_kv_blocks=256)
    rows = out["history"]
    assert len(rows) == 2
    for r in rows:
        assert r["parsed"] == 1.0  # every rolled-out decision held to the grammar
        assert math.isfinite(r["loss"]) and 0.0 <= r["turn_reward"] <= 1.0 and 0.0 <= r["trajectory_reward"] <= 1.0
        assert r["ratio"] > 0 and 0.0 <= r["adv_nonzero"] <= 1.0
    changed = sum(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert changed > 0
    # a step honours the class weights: every class weighed 0, no part has an advantage and the loss is 0
    from livemoe.train.live.gspo import SMGSPO, decision_class

    classes = {decision_class(iv) for s in sessions for iv in s["intervals"]}
    trainer = SMGSPO(model, tok, GSPOOptions(**{**vars(opts), "lambda_aux": 0.0}), {c: 0.0 for c in classes},
                     num_kv_blocks=256)
    row = trainer.step(sessions[:1], 0)
    assert row["adv_nonzero"] == 0.0 and row["loss"] == 0.0
