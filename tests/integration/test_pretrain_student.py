"""`python scripts/pretrain_student.py`: a few-step run writes a checkpoint that transformers and the engine
load alike and a report of what it reached; --init_from continues one, keeping the earlier report."""
import importlib.util
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from livemoe.train.synthetic.corpus import encode_conversation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/integration/ -> root


def load_script(name: str):
    """scripts/NAME.py as a module (scripts/ is not a package: its scripts run by path)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


pretrain_student = load_script("pretrain_student")
lr_factor, main = pretrain_student.lr_factor, pretrain_student.main

FEW = ["--steps", "3", "--eval_every", "2", "--batch_size", "2", "--turns", "2", "--heldout_rooms", "8",
       "--vocab_size", "400", "--warmup", "2"]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    main(["--output_dir", str(out), *FEW])
    return out


def test_few_steps_write_a_loadable_checkpoint_and_a_report(first):
    from transformers import AutoModelForCausalLM

    from livemoe import engine

    report = json.loads((first / "pretrain_report.json").read_text())
    assert report["steps"] == 3 and [h["step"] for h in report["history"]] == [2, 3]
    assert report["command"] == "python scripts/pretrain_student.py --output_dir " + str(first) + " " + " ".join(FEW)
    assert report["final_heldout_lookup_exact"] == report["history"][-1]["heldout_lookup_exact"]
    assert all(0 <= h["heldout_lookup_exact"] <= 1 and math.isfinite(h["loss"]) for h in report["history"])
    hf = AutoModelForCausalLM.from_pretrained(str(first)).eval()
    assert report["parameters"] == sum(p.numel() for p in hf.parameters())
    ours = engine.load_model(str(first), dtype=torch.float32, device="cpu")
    tok = engine.load_tokenizer(str(first))
    ids = torch.tensor([tok("<|im_start|>user\nwhat is the price of link 3?<|im_end|>\n")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
    assert [len(tok(t, add_special_tokens=False)["input_ids"]) for t in ("<think>", "</think>", "<|im_end|>")] == [1, 1, 1]


def test_init_from_continues_and_keeps_the_earlier_report(first, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "next"
    main(["--output_dir", str(out), "--init_from", str(first), *FEW[:2], *FEW[4:]])  # 3 steps, no eval_every
    earlier = json.loads((first / "pretrain_report.json").read_text())
    report = json.loads((out / "pretrain_report.json").read_text())
    assert report["init_report"] == earlier
    # step 0 is the starting checkpoint measured again on the same held-out rooms: what it reached then
    assert report["history"][0] == {"step": 0, "heldout_lookup_exact": earlier["final_heldout_lookup_exact"],
                                    "minutes": 0.0}
    assert report["history"][-1]["step"] == 3
    a = AutoModelForCausalLM.from_pretrained(str(first))
    b = AutoModelForCausalLM.from_pretrained(str(out))
    assert (out / "tokenizer.json").read_text() == (first / "tokenizer.json").read_text()
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_lr_decays_over_whichever_budget_ends_first():
    args = SimpleNamespace(steps=100, max_minutes=10.0, warmup=10)
    assert lr_factor(0, 0.0, args) == pytest.approx(0.1)  # warm-up
    assert 0.95 < lr_factor(9, 0.0, args) < 1.0  # warmed up; the cosine has begun
    assert lr_factor(50, 0.0, args) == pytest.approx(0.55)  # half the steps: halfway down to 0.1
    assert lr_factor(10, 5.0, args) == pytest.approx(0.55)  # half the minutes, few steps: the same
    assert lr_factor(100, 1.0, args) == pytest.approx(0.1) == lr_factor(20, 10.0, args)


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--init_from .*no checkpoint there"):
        main(["--output_dir", str(tmp_path / "o"), "--init_from", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--output_dir", str(tmp_path / "o"), "--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_curriculum_grows_the_product_lists_to_the_worlds_range():
    curriculum_products = pretrain_student.curriculum_products
    from livemoe.train.synthetic.world import WorldConfig, make_rooms

    world = WorldConfig()
    assert world.num_products == (4, 6)
    args = SimpleNamespace(curriculum_steps=300)
    ranges = [curriculum_products(s, args, world) for s in (0, 59, 60, 120, 180, 240, 299, 300, 10_000)]
    assert ranges == [(2, 2), (2, 2), (3, 3), (4, 4), (4, 5), (4, 6), (4, 6), (4, 6), (4, 6)]
    assert curriculum_products(0, SimpleNamespace(curriculum_steps=0), world) == (4, 6)  # off
    for lo_hi in ((2, 2), (4, 5)):
        rooms = make_rooms(32, seed=3, cfg=WorldConfig(num_products=lo_hi))
        counts = {len(r["documents"]) for r in rooms}
        assert counts and min(counts) >= lo_hi[0] and max(counts) <= lo_hi[1]


class _Oracle(torch.nn.Module):
    """Predicts every next token of the batch it is given (optionally one position wrong)."""

    def __init__(self, vocab, wrong_at=None):
        super().__init__()
        self.vocab, self.wrong_at = vocab, wrong_at

    def forward(self, input_ids):
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1).clone()
        if self.wrong_at is not None:
            for row in range(len(nxt)):
                at = self.wrong_at(input_ids[row].tolist())
                nxt[row, at - 1] = (nxt[row, at - 1] + 1) % self.vocab
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, self.vocab).float())


def test_lookup_probe_splits_by_question_form_and_scores_the_link(first):
    from transformers import AutoTokenizer

    PROBE_FORMS = pretrain_student.PROBE_FORMS
    lookup_probe = pretrain_student.lookup_probe
    from livemoe.train.synthetic.world import make_rooms

    tok = AutoTokenizer.from_pretrained(str(first))
    rooms = make_rooms(6, seed=5)
    perfect = lookup_probe(_Oracle(len(tok)), rooms, tok)
    forms = [k for k in perfect if k.startswith("form=")]
    assert sorted(forms) == sorted(f"form={f}" for f in PROBE_FORMS)
    assert perfect["all"]["n"] == 3 * len(rooms) and all(perfect[f]["n"] == len(rooms) for f in forms)
    assert all(v["exact"] == v["link"] == v["name"] == v["value"] == 1.0 for v in perfect.values())
    # the token after the answer's first "link" is the link number: wrong there, wrong link and answer
    head = tok("<|im_start|>assistant\nlink", add_special_tokens=False)["input_ids"]

    def link_position(ids):
        return max(i for i in range(len(ids) - len(head) + 1) if ids[i:i + len(head)] == head) + len(head)

    wrong = lookup_probe(_Oracle(len(tok), wrong_at=link_position), rooms, tok)
    assert all(v["exact"] == v["link"] == 0.0 and v["name"] == v["value"] == 1.0 for v in wrong.values())
    # one position before the "." that ends the answer: the value's last token
    dot = tok(".", add_special_tokens=False)["input_ids"]
    wrong = lookup_probe(_Oracle(len(tok), wrong_at=lambda ids: max(i for i, t in enumerate(ids) if [t] == dot) - 1),
                         rooms, tok)
    assert all(v["exact"] == v["value"] == 0.0 and v["link"] == v["name"] == 1.0 for v in wrong.values())


def test_model_shape_flags_and_the_report_probe(tmp_path, first):
    from transformers import AutoConfig

    out = tmp_path / "wide"
    main(["--output_dir", str(out), *FEW, "--heads", "8", "--kv_heads", "8", "--head_dim", "8",
          "--curriculum_steps", "2"])
    cfg = AutoConfig.from_pretrained(str(out))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 8, 8)
    report = json.loads((out / "pretrain_report.json").read_text())
    assert report["final_lookup_probe"]["all"]["n"] == 3 * 8 and report["args"]["curriculum_steps"] == 2
    with pytest.raises(SystemExit, match="model's shape is the checkpoint's; drop --heads"):
        main(["--output_dir", str(tmp_path / "x"), "--init_from", str(first), "--heads", "8"])


def _two_product_room():
    return {"id": "r", "question": "?", "history": [],
            "documents": [{"link": 7, "name": "wool scarf", "category": "scarf", "attributes": {"color": "red"}},
                          {"link": 31, "name": "green tea", "category": "tea", "attributes": {"price": "39 yuan"}}]}


def test_recall_sequence_is_a_compact_list_then_questions_on_its_facts():
    import random

    from livemoe.train.data import SYSTEM_PROMPT
    from livemoe.train.synthetic.corpus import recall_sequence
    from livemoe.train.synthetic.world import make_rooms, products_of

    msgs = recall_sequence(_two_product_room(), random.Random(0), queries=40)
    assert msgs[0] == {"role": "system", "content": SYSTEM_PROMPT + "\nproducts:\nlink 7: wool scarf. color: red.\n"
                                                    "link 31: green tea. price: 39 yuan."}
    assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * 40
    answers = [m["content"] for m in msgs[2::2]]
    assert set(answers) == {"link 7 wool scarf: color is red.", "link 31 green tea: price is 39 yuan."}
    # drawn independently, not in rounds of each fact once (rounds taught "not the link just answered"): some
    # round of two would hold one fact twice
    assert any(answers[i] == answers[i + 1] for i in range(0, 40, 2))
    for q, a in zip(msgs[1::2], msgs[2::2]):  # the question asks about the product and attribute answered
        link, name, attr = ("7", "wool scarf", "color") if "wool" in a["content"] else ("31", "green tea", "price")
        assert q["content"] in (f"what is the {attr} of the {name}?", f"how about the {attr} of the {name}?",
                                f"what is the {attr} of link {link}?")
    # a world room: one listed attribute per product, its value the product's own
    room = make_rooms(1, seed=4)[0]
    msgs = recall_sequence(room, random.Random(1), queries=12)
    lines = msgs[0]["content"].split("\n")[2:]
    products = products_of(room)
    assert len(lines) == len(products) >= 4
    for line, p in zip(lines, products):
        head, attr_part = line.split(". ", 1)
        assert head == f"link {p.link}: {p.name}" and attr_part.count(":") == 1
        attr, value = attr_part.rstrip(".").split(": ")
        assert p.attributes[attr] == value
    assert len(msgs) == 1 + 2 * 12


def test_recall_drill_loss_mask_covers_exactly_the_answers(first):
    import random

    from transformers import AutoTokenizer

    from livemoe.train.synthetic.corpus import recall_sequence

    tok = AutoTokenizer.from_pretrained(str(first))
    msgs = recall_sequence(_two_product_room(), random.Random(2), queries=3)
    ids, mask = encode_conversation(msgs, tok)
    assert len(ids) == len(mask) and sum(mask) > 0
    masked = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert masked == "".join(m["content"] + "<|im_end|>" for m in msgs[2::2])


def test_recall_steps_are_the_warm_up_then_the_fraction_spread_evenly():
    is_recall_step = pretrain_student.is_recall_step

    def kinds(warm, frac, n):
        return [is_recall_step(s, SimpleNamespace(recall_steps=warm, recall_fraction=frac)) for s in range(1, n + 1)]

    assert kinds(3, 0.0, 6) == [True] * 3 + [False] * 3
    assert kinds(0, 0.5, 6) == [False, True] * 3
    assert kinds(2, 1.0, 5) == [True] * 5
    for frac in (0.25, 0.3, 0.75):
        mix = kinds(10, frac, 1010)
        assert all(mix[:10]) and sum(mix[10:]) == int(1000 * frac)
        assert max(sum(mix[10 + i:20 + i]) for i in range(990)) <= int(10 * frac) + 1  # spread, not bunched


def test_recall_flags_run_and_are_refused_when_bad(tmp_path, capsys):
    out = tmp_path / "recall"
    main(["--output_dir", str(out), *FEW, "--recall_steps", "1", "--recall_fraction", "0.5", "--recall_queries", "4"])
    report = json.loads((out / "pretrain_report.json").read_text())
    # step 1 is the warm-up's, step 2 a conversation, step 3 a drill
    assert [(h["step"], h["recall_steps"]) for h in report["history"]] == [(2, 1), (3, 2)]
    assert report["args"]["recall_queries"] == 4 and all(h["cpu_minutes"] >= 0 for h in report["history"])
    for bad, says in ((["--recall_queries", "4"], "--recall_queries needs recall drills"),
                      (["--recall_fraction", "1.5"], "--recall_fraction must be in [0, 1]"),
                      (["--recall_steps", "-1"], "--recall_steps must be >= 0"),
                      (["--recall_steps", "2", "--recall_queries", "0"], "--recall_queries must be >= 1")):
        with pytest.raises(SystemExit):
            main(["--output_dir", str(tmp_path / "bad"), *bad])
        assert says in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--recall_steps" in text and "one attribute each, 2 to 6 products" in text and "default 8" in text


def test_widen_attention_computes_what_the_checkpoint_computed(first):
    from transformers import AutoModelForCausalLM

    widen_attention = pretrain_student.widen_attention

    narrow = AutoModelForCausalLM.from_pretrained(str(first), dtype=torch.float32).eval()
    h, kv = narrow.config.num_attention_heads, narrow.config.num_key_value_heads
    assert kv < h  # the default student shares KV heads: the copies are exercised
    wide = widen_attention(narrow, 2 * h).eval()
    assert (wide.config.num_attention_heads, wide.config.num_key_value_heads) == (2 * h, 2 * h)
    assert sum(p.numel() for p in wide.parameters()) > sum(p.numel() for p in narrow.parameters())
    ids = torch.randint(0, narrow.config.vocab_size, (2, 37))
    with torch.no_grad():
        torch.testing.assert_close(wide(ids).logits, narrow(ids).logits, rtol=1e-5, atol=1e-5)
    # the new heads are silent but trainable: their output columns get a gradient
    wide.train()
    wide(ids).logits.sum().backward()
    o = wide.model.layers[0].self_attn.o_proj.weight
    d = wide.config.head_dim
    assert torch.all(o[:, h * d:] == 0) and o.grad[:, h * d:].abs().sum() > 0
    with pytest.raises(SystemExit, match="cannot remove heads"):
        widen_attention(narrow, h - 1)


def test_widen_hidden_computes_what_the_checkpoint_computed(first):
    from transformers import AutoModelForCausalLM

    widen_hidden = pretrain_student.widen_hidden

    narrow = AutoModelForCausalLM.from_pretrained(str(first), dtype=torch.float32).eval()
    d = narrow.config.hidden_size
    wide = widen_hidden(narrow, d + 24).eval()  # an odd widening: nothing assumes a doubling
    assert wide.config.hidden_size == d + 24
    ids = torch.randint(0, narrow.config.vocab_size, (2, 37))
    with torch.no_grad():
        out_n, out_w = narrow(ids, output_hidden_states=True), wide(ids, output_hidden_states=True)
    # exact but for the per-head q/k norms' eps (scaled with the hidden norms'): 1e-6 relative, logits ~10
    torch.testing.assert_close(out_w.logits, out_n.logits, rtol=1e-5, atol=1e-4)
    assert len(out_w.hidden_states) == len(out_n.hidden_states) > 1
    for h_w, h_n in zip(out_w.hidden_states, out_n.hidden_states):
        assert torch.all(h_w[..., d:] == 0)  # the new dimensions start silent
        torch.testing.assert_close(h_w[..., :d], h_n, rtol=1e-5, atol=1e-4)
    # ... and trainable: what writes them gets a gradient there
    wide.train()
    wide(ids).logits.square().sum().backward()
    assert wide.model.embed_tokens.weight.grad[:, d:].abs().sum() > 0
    assert wide.model.layers[0].self_attn.o_proj.weight.grad[d:].abs().sum() > 0
    assert wide.model.layers[1].mlp.experts.down_proj.grad[:, d:].abs().sum() > 0
    with pytest.raises(SystemExit, match="must grow it"):
        widen_hidden(narrow, d)


@pytest.mark.parametrize("flag", ["--widen_heads", "--widen_hidden"])
def test_widening_needs_init_from(tmp_path, flag, capsys):
    with pytest.raises(SystemExit):
        main(["--output_dir", str(tmp_path), flag, "8", *FEW])
    assert f"{flag} needs --init_from" in capsys.readouterr().err


def test_init_from_with_widen_heads_writes_the_wider_model(first, tmp_path):
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(str(first)).hidden_size + 8
    main(["--output_dir", str(tmp_path), "--init_from", str(first), "--widen_heads", "8", "--widen_hidden",
          str(hidden), *FEW[:2], *FEW[4:]])
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size) == (8, 8, hidden)
    args = json.loads((tmp_path / "pretrain_report.json").read_text())["args"]
    assert (args["widen_heads"], args["widen_hidden"]) == (8, hidden)
