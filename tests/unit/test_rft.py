"""RFT: loss masking, marker weights, the aux-loss term, accumulation, batching, the end-to-end tiny run
(its checkpoint loads in transformers), exact resume, and bad input stopping with a clear message."""
import contextlib
import json
import os
import random
import shutil

import pytest
import torch

from fixtures import assert_stopped_on_nonfinite
from test_pretrain_student import pretrain_student  # scripts/pretrain_student.py: the student's shape
from livemoe.train.config import ConfigError
from livemoe.train.rft.config import RFTConfig
from livemoe.train.data import build_prompt
from livemoe.train.rft.__main__ import main
from livemoe.train.rft.trainer import run
from livemoe.train.sft import collate, encode_example, epoch_batches, marker_token_ids, sft_step_loss
from livemoe.train.synthetic import ScriptedTeacher, make_rooms

NULL = contextlib.nullcontext()


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """A tiny random student with the synthetic world's tokenizer and chat template (a real checkpoint dir)."""
    from livemoe.train.synthetic.corpus import tokenizer_corpus
    from livemoe.train.synthetic.tokenizer import train_tokenizer

    path = str(tmp_path_factory.mktemp("student"))
    tok = train_tokenizer(tokenizer_corpus(n_rooms=150), vocab_size=400)
    model = pretrain_student.init_student(tok, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, moe_intermediate_size=32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(student):
    from livemoe import engine

    return engine.load_model(student, dtype=torch.float32, device="cpu"), engine.load_tokenizer(student)


def kept_examples(n=6, seed=0):
    rooms = make_rooms(n, seed=seed)
    return [{**r, "completion": c} for r, c in zip(rooms, (ScriptedTeacher().answer(r, 0, "good", True) for r in rooms))]


def test_encode_masks_the_prompt_and_weights_markers(loaded):
    _, tok = loaded
    rec = kept_examples(1)[0]
    markers = marker_token_ids(tok, "<think>,</think>")
    e = encode_example(rec, tok, 4096, set(markers), marker_weight=3.0)
    prompt_len = len(tok(build_prompt(rec, tok), add_special_tokens=False)["input_ids"])
    w = e["weights"]
    assert all(x == 0 for x in w[: prompt_len - 1]) and all(x > 0 for x in w[prompt_len - 1:])
    targets = e["input_ids"][1:]
    assert [t for t, x in zip(targets, w) if x == 3.0] == markers  # exactly <think> and </think>, once each
    assert targets[-1] == tok.eos_token_id and w[-1] == 1.0  # the model learns to stop
    assert encode_example(rec, tok, prompt_len, set(), 1.0) is None  # truncation leaves no completion
    with pytest.raises(ValueError, match="must be one token"):
        marker_token_ids(tok, "not one token")


def reference_loss(model, batch):
    """Plain fp32: weighted next-token NLL from full logits."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1].float()
    lp = torch.log_softmax(logits, -1)
    t = batch["targets"]
    nll = -lp.gather(-1, t.clamp(min=0)[..., None])[..., 0]
    w = batch["weights"] * (t != -100)
    return (nll * w).sum() / w.sum()


def test_loss_is_completion_only_and_aux_term_is_added(loaded):
    model, tok = loaded
    examples = [encode_example(r, tok, 4096, set(marker_token_ids(tok, "<think>,</think>")), 2.0)
                for r in kept_examples(3)]
    b = collate(examples, tok.pad_token_id, "cpu")
    norm = (b["weights"] * (b["targets"] != -100)).sum()
    total, loss, aux = sft_step_loss(model, b, norm, 0.0, 1, NULL)
    # tolerance: fused chunked log-probs vs full log_softmax, both fp32
    torch.testing.assert_close(loss, reference_loss(model, b).detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(total.detach(), loss)
    total2, loss2, aux2 = sft_step_loss(model, b, norm, 0.5, 2, NULL)
    _, router_logits = model.forward_hidden(b["input_ids"], attention_mask=b["attention_mask"], return_router_logits=True)
    want_aux = model.load_balancing_loss(router_logits, attention_mask=b["attention_mask"])
    torch.testing.assert_close(aux2, want_aux.detach())
    torch.testing.assert_close(total2.detach(), loss2 + 0.5 * want_aux.detach() / 2)
    assert aux2 > 0
    # changing a prompt token's target (masked) does not move the loss
    b2 = {k: v.clone() for k, v in b.items()}
    first = int((b["weights"][0] == 0).nonzero()[0])
    b2["weights"][0, first] = 0.0
    assert torch.equal(sft_step_loss(model, b2, norm, 0.0, 1, NULL)[1], loss)


def test_no_target_tokens_is_a_clear_error(loaded):
    model, tok = loaded
    e = encode_example(kept_examples(1)[0], tok, 4096)
    b = collate([{**e, "weights": [0.0] * len(e["weights"])}], tok.pad_token_id, "cpu")
    with pytest.raises(ValueError, match="no target token"):
        sft_step_loss(model, b, None, 0.0, 1, NULL)


def test_accumulation_equals_the_big_batch(loaded):
    model, tok = loaded
    examples = [encode_example(r, tok, 4096) for r in kept_examples(4)]

    def grads(groups):
        model.zero_grad()
        batches = [collate(g, tok.pad_token_id, "cpu") for g in groups]
        norm = sum((b["weights"] * (b["targets"] != -100)).sum() for b in batches)
        for b in batches:
            sft_step_loss(model, b, norm, 0.0, len(groups), NULL)[0].backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    one, two = grads([examples]), grads([examples[:2], examples[2:]])
    for a, b in zip(one, two):  # fp32 sums in a different order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    model.zero_grad()


def test_epoch_batches_cover_everything_deterministically():
    lengths = [5, 50, 7, 48, 6, 49, 8, 51]
    for batching in ("bucket", "pad"):
        b = epoch_batches(lengths, 2, batching, seed=3)
        assert sorted(i for x in b for i in x) == list(range(8))
        assert b == epoch_batches(lengths, 2, batching, seed=3) and b != epoch_batches(lengths, 2, batching, seed=4)
    spreads = [max(lengths[i] for i in x) - min(lengths[i] for i in x) for x in epoch_batches(lengths, 2, "bucket", 0)]
    assert max(spreads) <= 3  # bucketed: similar lengths together


def tiny_cfg(student, out, **kw):
    base = dict(model=student, output_dir=str(out), train_rooms=12, eval_rooms=4, k=2, max_steps=2, batch_size=4,
                eval_max_new_tokens=8, progress=False, warmup_steps=1, lr=1e-2)
    return RFTConfig(**{**base, **kw})


def test_rehearsal_examples_train_the_pretraining_answers_after_the_rooms_turns(loaded):
    from livemoe.train.rft.trainer import REHEARSAL_SKIP, rehearsal_examples
    from livemoe.train.synthetic.corpus import QUESTIONS_PER_CONVERSATION, encode_conversation, lookup_conversation

    _, tok = loaded
    rooms = make_rooms(3, seed=5)
    cfg = RFTConfig(model="m", rehearsal=0.5, max_len=4096)
    examples = rehearsal_examples(cfg, tok, rooms, 5)
    assert len(examples) == 5 and examples == rehearsal_examples(cfg, tok, rooms, 5)  # deterministic
    # the same conversations rebuilt by hand: the weights are the pre-training answer mask, shifted to
    # "predict the next token", with the first REHEARSAL_SKIP answers (and the product list) left out
    rng = random.Random(f"rehearsal/{cfg.seed}")
    for i, ex in enumerate(examples):
        msgs = lookup_conversation(rooms[i % 3], rng, QUESTIONS_PER_CONVERSATION)
        ids, mask = encode_conversation(msgs, tok)
        assert ex["input_ids"] == ids and len(ex["weights"]) == len(ids) - 1
        answers = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
        assert len(answers) == QUESTIONS_PER_CONVERSATION > REHEARSAL_SKIP
        first_trained = len(encode_conversation(msgs[:answers[REHEARSAL_SKIP]], tok)[0])
        trained = [j + 1 for j, w in enumerate(ex["weights"]) if w]
        assert trained and min(trained) > first_trained
        assert trained == [j for j, m in enumerate(mask) if m and j > first_trained]
        # what is trained decodes to the later bare answers, each with its end token
        later = [msgs[j]["content"] + "<|im_end|>" for j in answers[REHEARSAL_SKIP:]]
        assert tok.decode([ids[j] for j in trained]) == "".join(later)


def test_rehearsal_mixes_into_the_sft_data_and_needs_the_synthetic_world(student, tmp_path, capsys):
    out = tmp_path / "run"
    result = run(tiny_cfg(student, out, rehearsal=1.0, eval_rooms=0))
    kept = len((out / "selected.jsonl").read_text().splitlines())
    assert kept > 0 and result["examples"] == 2 * kept  # as many rehearsal conversations as selected answers
    assert f"SFT: {2 * kept} examples ({kept} of them rehearsal" in capsys.readouterr().out
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(make_rooms(1, seed=0)[0]) + "\n")
    assert main(["--model", student, "--output_dir", str(tmp_path / "x"), "--data", str(data),
                 "--rehearsal", "0.5"]) == 2
    assert "--rehearsal replays the synthetic world" in capsys.readouterr().err


def test_end_to_end_tiny_run_checkpoint_loads_in_transformers(student, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from livemoe import engine

    out = tmp_path / "run"
    result = run(tiny_cfg(student, out))
    printed = capsys.readouterr().out
    assert "| student + RFT |" in printed and "| student |" in printed and "resolved config" in printed
    table = (out / "eval_table.md").read_text()
    assert table.count("\n") == 5 and "TPR" in table and "D. GFLOPs" in table
    selected = [json.loads(x) for x in (out / "selected.jsonl").read_text().splitlines()]
    assert 0 < len(selected) <= 12 and all(s["verdict"]["correct"] and s["verdict"]["helpful"] for s in selected)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["aux_loss"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert (out / "curves.png").stat().st_size > 1000 and (out / "config.yaml").exists()
    # the final model: transformers loads it and computes the engine's logits; training moved the weights
    hf = AutoModelForCausalLM.from_pretrained(result["final_dir"]).eval()
    ours = engine.load_model(result["final_dir"], dtype=torch.float32, device="cpu")
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
    start = engine.load_model(student, dtype=torch.float32, device="cpu")
    changed = [not torch.equal(a, b) for a, b in zip(start.parameters(), ours.parameters())]
    assert sum(changed) >= len(changed) - 1  # every tensor but perhaps an unused expert moved


def test_eval_every_logs_the_heldout_loss_of_the_selected_teacher_answers(student, tmp_path):
    from livemoe import engine

    out = tmp_path / "run"
    run(tiny_cfg(student, out, max_steps=5, eval_every=2, eval_rooms=6, eval_samples=1, eval_temperature=0,
                 wrong_link_rate=0, deflect_rate=0))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 2, 4, 5]  # step 0, every 2 steps, and the last step
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]  # training rows unchanged
    held = [json.loads(x) for x in (out / "heldout_selected.jsonl").read_text().splitlines()]
    assert 0 < len(held) <= 6 and all(h["id"].startswith("eval") for h in held)
    # step 0's value is the plain fp32 completion loss of the starting model on those answers
    model, tok = engine.load_model(student, dtype=torch.float32, device="cpu"), engine.load_tokenizer(student)
    batch = collate([encode_example(h, tok, 1024) for h in held], tok.pad_token_id, "cpu")
    with torch.no_grad():
        assert evals[0][1] == pytest.approx(reference_loss(model, batch).item(), rel=1e-4)
    assert evals[-1][1] < evals[0][1]  # lr 1e-2 on a random model: the held-out loss falls too


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(student, tmp_path):
    from livemoe import engine

    out = tmp_path / "run"
    cfg = tiny_cfg(student, out, max_steps=4, save_every=2, keep_last=5, eval_rooms=0, batch_size=2)
    run(cfg)
    full = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    final_full = engine.load_model(str(out / "final"), dtype=torch.float32, device="cpu")
    # "crash" after step 2: the step-4 checkpoint and the export never happened
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    shutil.rmtree(out / "final")
    run(tiny_cfg(student, out, max_steps=4, save_every=2, keep_last=5, eval_rooms=0, batch_size=2, resume="auto"))
    resumed = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]  # exact on the CPU
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full]
    final_resumed = engine.load_model(str(out / "final"), dtype=torch.float32, device="cpu")
    for a, b in zip(final_full.parameters(), final_resumed.parameters()):
        assert torch.equal(a, b)


def test_bad_jsonl_line_stops_with_file_and_line(student, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    rooms = make_rooms(3, seed=0)
    lines = [json.dumps(r) for r in rooms]
    lines.insert(1, '{"documents": [}')
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o"
    code = main(["--model", student, "--data", str(data), "--output_dir", str(out), "--progress", "false"])
    err = capsys.readouterr().err
    assert code == 2 and f"{data}:2: malformed JSON" in err and "Traceback" not in err
    code = main(["--model", student, "--data", str(data), "--output_dir", str(out), "--progress", "false",
                 "--skip_bad_lines", "--max_steps", "1", "--k", "1", "--wrong_link_rate", "0", "--deflect_rate", "0"])
    assert code == 0, capsys.readouterr().err
    assert "skipped 1 bad line(s): line 2" in capsys.readouterr().out


def test_empty_selection_stops_with_a_clear_message(student, tmp_path, capsys):
    out = tmp_path / "o"
    code = main(["--model", student, "--output_dir", str(out), "--train_rooms", "4", "--wrong_link_rate", "1",
                 "--deflect_rate", "0", "--progress", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "empty selection: none of 4 inputs" in err
    assert (out / "candidates.jsonl").exists()  # what was produced is kept for inspection


def test_unreachable_teacher_fails_fast_naming_the_url(student, tmp_path, capsys):
    code = main(["--model", student, "--output_dir", str(tmp_path / "o"), "--teacher", "http://127.0.0.1:9/v1",
                 "--progress", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "http://127.0.0.1:9/v1/chat/completions: unreachable" in err


def test_bad_model_dir(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    code = main(["--model", str(tmp_path / "empty"), "--output_dir", str(tmp_path / "o"), "--train_rooms", "4",
                 "--progress", "false"])
    assert code == 2 and "error:" in capsys.readouterr().err


def test_engine_checkpoint_teacher_samples_k_per_input_with_the_decoder(student):
    from livemoe.train.teachers import EngineTeacher

    rooms = make_rooms(2, seed=3)
    teacher = EngineTeacher(student, max_new_tokens=6, seed=1, progress=False)
    a = teacher.sample(rooms, k=3, temperature=0.7)
    assert len(a) == 2 and all(len(c) == 3 and all(isinstance(t, str) for t in c) for c in a)
    assert len({t for c in a for t in c}) > 1  # sampled, not greedy copies
    assert teacher.sample(rooms, k=3, temperature=0.7) == a  # seeded


def test_engine_teacher_with_speculative_decoding_drafts_and_keeps_its_greedy_answers(student):
    """--teacher_speculative_config: the teacher's decoder drafts (n-gram over the room's prompt), and greedy answers
    equal the plain teacher's token for token (speculation is exact)."""
    from livemoe.train.teachers import EngineTeacher

    rooms = make_rooms(2, seed=3)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64}'
    plain = EngineTeacher(student, max_new_tokens=12, seed=1, progress=False)
    fast = EngineTeacher(student, max_new_tokens=12, seed=1, progress=False, speculative_config=spec)
    assert fast.sample(rooms, k=1, temperature=0.0) == plain.sample(rooms, k=1, temperature=0.0)
    assert fast.llm.stats()["spec_drafted_tokens"] > 0


def test_teacher_speculative_config_is_checked_and_needs_a_checkpoint_teacher(student):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    with pytest.raises(ConfigError, match="--teacher_speculative_config: speculative_config: unknown key"):
        tiny_cfg(student, "o", teacher=student, teacher_speculative_config='{"method": "ngram", "k": 3}').validate()
    with pytest.raises(ConfigError, match="for a checkpoint --teacher"):
        tiny_cfg(student, "o", teacher_speculative_config=spec).validate()
    tiny_cfg(student, "o", teacher=student, teacher_speculative_config=spec).validate()


def test_gradient_checkpointing_gives_the_same_losses(student, tmp_path):
    runs = []
    for gc in (False, True):
        out = tmp_path / f"gc{gc}"
        run(tiny_cfg(student, out, eval_rooms=0, gradient_checkpointing=gc, marker_weight=2.0, grad_accum=2))
        runs.append([json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()])
    for a, b in zip(*runs):  # recomputation in the backward pass: same fp32 ops, same order
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_a_diverging_run_stops_keeps_its_last_good_checkpoint_and_exports_nothing(student, tmp_path, capsys):
    out = tmp_path / "nan"
    code = main(["--model", student, "--output_dir", str(out), "--lr", "1e9", "--train_rooms", "12", "--eval_rooms", "0",
                 "--k", "2", "--batch_size", "4", "--max_steps", "8", "--warmup_steps", "0", "--save_every", "1",
                 "--keep_last", "1", "--max_nonfinite_steps", "2", "--progress", "false"])
    assert_stopped_on_nonfinite(code, capsys.readouterr().err, out)


def test_token_balanced_micro_batches_give_the_same_losses(student, tmp_path):
    """--max_tokens_per_micro_batch regroups a step's --grad_accum x --batch_size examples by tokens (here one
    example each at a budget of 1 token, all four in one at a large budget); the loss is normalised over the step,
    so the losses and gradient norms are the fixed-row run's (fp32, sums in another order: rel 1e-5). The
    load-balancing term is a per-micro-batch mean, off here."""
    losses = {}
    for name, budget in (("rows", 0), ("one_each", 1), ("all_in_one", 10**6)):
        out = tmp_path / name
        run(tiny_cfg(student, out, max_steps=2, eval_rooms=0, batch_size=2, grad_accum=2, lambda_aux=0.0,
                     max_tokens_per_micro_batch=budget))
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [(r["loss"], r["grad_norm"]) for r in rows]
    for name in ("one_each", "all_in_one"):
        assert [x for r in losses[name] for x in r] == pytest.approx([x for r in losses["rows"] for x in r], rel=1e-5)
