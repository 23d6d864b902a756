"""`python -m train.pretrain_student`: a few-step run writes a checkpoint that transformers and the engine
load alike and a report of what it reached; --init_from continues one, keeping the earlier report."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from train.pretrain_student import lr_factor, main

FEW = ["--steps", "3", "--eval_every", "2", "--batch_size", "2", "--turns", "2", "--heldout_rooms", "8",
       "--vocab_size", "400", "--warmup", "2"]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    main(["--output_dir", str(out), *FEW])
    return out


def test_few_steps_write_a_loadable_checkpoint_and_a_report(first):
    from transformers import AutoModelForCausalLM

    import engine

    report = json.loads((first / "pretrain_report.json").read_text())
    assert report["steps"] == 3 and [h["step"] for h in report["history"]] == [2, 3]
    assert report["command"] == "python -m train.pretrain_student --output_dir " + str(first) + " " + " ".join(FEW)
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
