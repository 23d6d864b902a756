"""Rollouts from the decoder running the very module being trained: K seeded completions per prompt,
the decoder's raw old_logprobs equal the trainer's fused recomputation (fp32), no weight copy (an
update is seen at the next rollout), the KV cache released for the update, multi-turn masks, L_ref
computed once."""
import pytest
import torch

from livemoe.engine.model.loader import load_model, load_tokenizer
from livemoe.kernels.logprobs import fused_linear_logprobs
from tiny_models import make_checkpoint
from livemoe.train.rollout import Completion, Rollouts, collate, reference_lengths


def make_student(path, seed: int = 0):
    """A tiny random Qwen3-MoE with the synthetic world's own BPE tokenizer (trained on a few rooms)."""
    from livemoe.train.synthetic.corpus import tokenizer_corpus
    from livemoe.train.synthetic.tokenizer import train_tokenizer

    tok = train_tokenizer(tokenizer_corpus(n_rooms=40), vocab_size=500)
    path, _ = make_checkpoint(path, moe=True, seed=seed, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, bos_token_id=None, num_hidden_layers=2,
                              max_position_embeddings=2048)
    tok.save_pretrained(path)
    return path


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/fixtures.py: tiny matmuls, shared CPU


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_student(tmp_path_factory.mktemp("student") / "ckpt")


@pytest.fixture
def model_and_tok(student):
    return load_model(student, dtype=torch.float32), load_tokenizer(student)


def trainer_logprobs(model, batch, temperature):
    hidden = model.forward_hidden(batch["input_ids"], attention_mask=batch["attention_mask"])
    return fused_linear_logprobs(hidden[:, :-1], model.lm_head_weight, batch["targets"], temperature,
                                 mask=batch["completion_mask"] > 0)


PROMPTS = ["user\nwhat is the price of link 3?\nassistant\n", "user\ndo you have mango zongzi?\nassistant\n"]


def test_k_seeded_completions_and_old_logprobs_match_the_trainer(model_and_tok):
    model, tok = model_and_tok
    ro = Rollouts(model, tok, num_generations=4, max_new_tokens=12, temperature=0.7, seed=3, num_kv_blocks=64)
    assert ro.llm.model is model  # the very module, not a copy
    groups = ro.generate(PROMPTS, step=0)
    assert [len(g) for g in groups] == [4, 4]
    comps = [c for g in groups for c in g]
    assert len({tuple(c.token_ids) for c in comps}) > 1  # sampled, not all the same
    assert all(len(c.old_logprobs) == len(c.token_ids) for c in comps)
    again = ro.generate(PROMPTS, step=0)
    assert [c.token_ids for g in again for c in g] == [c.token_ids for c in comps]  # seeded per (seed, step, prompt)
    other = ro.generate(PROMPTS, step=1)
    assert [c.token_ids for g in other for c in g] != [c.token_ids for c in comps]

    batch = collate(comps, [0.0] * len(comps), pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp = trainer_logprobs(model, batch, 0.7)
    mask = batch["completion_mask"]
    assert mask.sum() == sum(len(c.token_ids) for c in comps)
    # fp32 both sides; the paged decode path and the padded training forward sum in different orders
    diff = ((lp - batch["old_logprobs"]) * mask).abs().max()
    assert diff < 2e-5, diff


def test_speculative_rollouts_are_the_same_rollouts(model_and_tok):
    """GRPO's --rollout_speculative_config: seeded ngram speculation gives each rollout the tokens it gets without,
    and the old log-probs of every token are the target's."""
    model, tok = model_and_tok
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64}
    kw = dict(num_generations=4, max_new_tokens=24, temperature=0.7, seed=3, num_kv_blocks=128)
    plain, fast = Rollouts(model, tok, **kw), Rollouts(model, tok, speculative_config=spec, **kw)
    a = [c for g in plain.generate(PROMPTS, step=0) for c in g]
    b = [c for g in fast.generate(PROMPTS, step=0) for c in g]
    assert [c.token_ids for c in b] == [c.token_ids for c in a]
    for x, y in zip(a, b):  # a k+1-token chunk and a one-token decode sum in another order
        assert max(abs(p - q) for p, q in zip(x.old_logprobs, y.old_logprobs)) < 1e-4
    assert fast.llm.stats()["spec_drafted_tokens"] > 0


def test_an_update_is_seen_and_the_kv_cache_is_released(model_and_tok):
    model, tok = model_and_tok
    ro = Rollouts(model, tok, num_generations=2, max_new_tokens=8, temperature=1.0, num_kv_blocks=32)
    before = ro.generate(PROMPTS[:1], step=0)[0]
    ro.release()
    assert ro.llm.core.runner.kv_cache is None
    with torch.no_grad():
        model.lm_head_weight.mul_(3.0)  # an in-place "optimizer step" on the shared module
    after = ro.generate(PROMPTS[:1], step=0)[0]  # the cache comes back; the prefix cache was reset
    assert ro.llm.core.runner.kv_cache is not None
    batch = collate(after, [0.0, 0.0], tok.pad_token_id)
    with torch.no_grad():
        lp = trainer_logprobs(model, batch, 1.0)
    assert ((lp - batch["old_logprobs"]) * batch["completion_mask"]).abs().max() < 2e-5
    assert [c.old_logprobs for c in after] != [c.old_logprobs for c in before]


def test_collate_aligns_targets_and_masks_multi_turn_tokens():
    c = Completion(prompt_ids=[5, 6, 7], token_ids=[10, 11, 2, 20, 21, 12, 2], old_logprobs=[-1, -2, -3, 0, 0, -4, -5],
                   text="", finish_reason="stop", turn_spans=[(0, 3), (5, 7)])
    single = Completion([5, 6], [30, 2], [-0.5, -0.25], "", "stop")
    adv_tokens = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, -2.0, -2.0])
    b = collate([c, single], [adv_tokens, 0.5], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 10, 11, 2, 20, 21, 12, 2], [5, 6, 30, 2, 0, 0, 0, 0, 0, 0]]
    assert b["targets"][0].tolist() == b["input_ids"][0, 1:].tolist()
    # row 0: the hidden state at position 2 (last prompt token) predicts the first completion token
    assert b["completion_mask"][0].tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert b["old_logprobs"][0].tolist() == [0, 0, -1, -2, -3, 0, 0, -4, -5]
    assert b["advantages"][0].tolist() == [0, 0, 1, 1, 1, 0, 0, -2, -2]
    assert b["completion_mask"][1].tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0]
    assert b["advantages"][1].tolist() == [0, 0.5, 0.5, 0, 0, 0, 0, 0, 0]
    truncated = Completion([5], [7, 8], [-1, -1], "", "length")
    assert collate([truncated], [1.0], 0, mask_truncated=True)["completion_mask"].sum() == 0
    with pytest.raises(ValueError, match="token advantages"):
        collate([c], [torch.ones(3)], 0)


def test_multi_turn_rollout_continues_from_the_exact_tokens(model_and_tok):
    model, tok = model_and_tok
    ro = Rollouts(model, tok, num_generations=2, max_new_tokens=6, temperature=1.0, num_kv_blocks=64)
    nxt = tok.encode("\nuser\nand the price?\nassistant\n")
    groups = ro.generate_multi_turn([PROMPTS[0]], [[nxt]], step=0)
    for c in groups[0]:
        assert len(c.turn_spans) == 2 and len(c.turn_texts) == 2
        s0, e0 = c.turn_spans[0]
        s1, _ = c.turn_spans[1]
        assert s0 == 0 and c.token_ids[e0:s1] == nxt  # the user turn sits between the assistant turns
    batch = collate(groups[0], [0.0, 0.0], tok.pad_token_id)
    with torch.no_grad():
        lp = trainer_logprobs(model, batch, 1.0)
    assert ((lp - batch["old_logprobs"]) * batch["completion_mask"]).abs().max() < 2e-5
    assert batch["completion_mask"].sum() == sum(e - s for c in groups[0] for s, e in c.turn_spans)


def test_reference_lengths_are_computed_once(model_and_tok):
    model, tok = model_and_tok
    ro = Rollouts(model, tok, num_generations=2, max_new_tokens=10, num_kv_blocks=64)
    calls = []
    greedy = ro.greedy
    ro.greedy = lambda prompts, *a: calls.append(len(prompts)) or greedy(prompts, *a)
    records = [{"id": "a"}, {"id": "b"}]
    cache = reference_lengths(ro, records, PROMPTS, {})
    assert set(cache) == {"a", "b"} and all(1 <= v <= 10 for v in cache.values())
    assert cache["a"] == max(1, ro.greedy([PROMPTS[0]])[0].length)  # greedy: deterministic
    calls.clear()
    reference_lengths(ro, records, PROMPTS, cache)
    assert calls == []
    # sampled: the mean length of n seeded samples per prompt, the same whatever the batch holds
    sampled = reference_lengths(ro, records, PROMPTS, {}, samples=3)
    alone = reference_lengths(ro, records[1:], PROMPTS[1:], {}, samples=3)
    assert sampled["b"] == alone["b"]
    groups = ro.generate(PROMPTS, "ref", n=3, keys=["a", "b"])
    assert sampled["a"] == pytest.approx(sum(c.length for c in groups[0]) / 3)


def _interrupted_after(ro, step_count: int, new_weights: dict, version: int = 1):
    """ro.between_steps: after `step_count` engine steps, ro.update_weights(new_weights) (in_flight interrupt)."""
    seen = [0]

    def hook():
        seen[0] += 1
        if seen[0] == step_count:
            ro.update_weights(new_weights.items(), version)

    ro.between_steps = hook


def test_an_interrupted_rollout_resumes_with_its_versions_and_the_uninterrupted_tokens(model_and_tok):
    """Partial rollouts (async GRPO): a weight update between engine steps interrupts the sequences in flight (their
    KV freed, recomputed on the update); they resume where they stopped with their own seeded draws. With the same
    weights the tokens are exactly the uninterrupted run's, the log-probs equal to 1e-5 (a prefill recomputes what
    decode steps computed: fp32 sums in another order), and every token records the version that drew it."""
    import copy

    model, tok = model_and_tok
    kw = dict(num_generations=3, max_new_tokens=12, temperature=1.0, seed=5, num_kv_blocks=64)
    plain = [c for g in Rollouts(copy.deepcopy(model), tok, **kw).generate(PROMPTS, step=0) for c in g]
    ro = Rollouts(copy.deepcopy(model), tok, **kw)
    _interrupted_after(ro, 4, {n: p.detach().clone() for n, p in model.named_parameters()})
    got = [c for g in ro.generate(PROMPTS, step=0) for c in g]
    assert ro.llm.stats()["num_preemptions"] >= len(got)  # every sequence in flight was interrupted
    cut = []
    for a, b in zip(plain, got):
        assert b.token_ids == a.token_ids
        assert b.old_logprobs == pytest.approx(a.old_logprobs, abs=1e-5)
        k = b.versions.count(0)
        assert b.versions == [0] * k + [1] * (len(b.token_ids) - k)
        cut.append(k)
    assert any(0 < k < len(c.token_ids) for k, c in zip(cut, got))  # stopped mid-way and resumed
    assert ro.version == 1


def test_an_interrupted_rollout_continues_on_the_new_weights(model_and_tok):
    """With other weights: the tokens drawn before the interruption are the old weights' run's and their behaviour
    log-probs the old model's; those after it are the new model's (each equal to the trainer's fused recomputation
    with the weights of its version, fp32, 2e-5)."""
    import copy

    model, tok = model_and_tok
    new_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    kw = dict(num_generations=3, max_new_tokens=12, temperature=1.0, seed=5, num_kv_blocks=64)
    plain = [c for g_ in Rollouts(copy.deepcopy(model), tok, **kw).generate(PROMPTS, step=0) for c in g_]
    ro = Rollouts(copy.deepcopy(model), tok, **kw)
    _interrupted_after(ro, 4, dict(new_model.named_parameters()))
    got = [c for g_ in ro.generate(PROMPTS, step=0) for c in g_]
    batch = collate(got, [0.0] * len(got), pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp = {0: trainer_logprobs(model, batch, 1.0), 1: trainer_logprobs(new_model, batch, 1.0)}
    resumed = 0
    for i, (a, b) in enumerate(zip(plain, got)):
        k = b.versions.count(0)
        assert b.token_ids[:k] == a.token_ids[:k]
        p = len(b.prompt_ids)
        for t, v in enumerate(b.versions):
            assert abs(lp[v][i, p - 1 + t] - b.old_logprobs[t]) < 2e-5, (i, t, v)
        resumed += k < len(b.token_ids)
    assert resumed > 0


def test_an_interrupted_multi_turn_rollout_resumes_with_its_versions_and_the_uninterrupted_tokens(model_and_tok):
    """Partial multi-turn rollouts: a weight update between two engine steps of a turn interrupts it; with the same
    weights every trajectory's tokens (both turns and the inserted user turn) are the uninterrupted run's, the
    log-probs to 1e-5, and the versions switch once, at the interruption: the inserted user turn takes the version
    of the policy that read it (its next turn's first token's)."""
    import copy

    model, tok = model_and_tok
    kw = dict(num_generations=2, max_new_tokens=6, temperature=1.0, seed=3, num_kv_blocks=64)
    nxt = tok.encode("\nuser\nand the price?\nassistant\n")
    convs = ([PROMPTS[0], PROMPTS[1]], [[nxt], [nxt]])
    plain = [c for g in Rollouts(copy.deepcopy(model), tok, **kw).generate_multi_turn(*convs, step=0) for c in g]
    assert all(not c.versions for c in plain)  # one version throughout: the producer stamps it
    for step_count in (2, 8):  # within the first turn, and (after its up to 6 steps) within the second
        ro = Rollouts(copy.deepcopy(model), tok, **kw)
        _interrupted_after(ro, step_count, {n: p.detach().clone() for n, p in model.named_parameters()})
        got = [c for g in ro.generate_multi_turn(*convs, step=0) for c in g]
        assert ro.version == 1
        cuts = []
        for a, b in zip(plain, got):
            assert b.token_ids == a.token_ids and b.turn_spans == a.turn_spans
            assert b.old_logprobs == pytest.approx(a.old_logprobs, abs=1e-5)
            k = b.versions.count(0)
            assert b.versions == [0] * k + [1] * (len(b.token_ids) - k)
            (_, e0), (s1, _) = b.turn_spans
            assert len(set(b.versions[e0:s1 + 1])) == 1  # the user turn and the next turn's first token
            cuts.append(k)
        assert any(0 < k < len(c.token_ids) for k, c in zip(cuts, got)), step_count  # stopped mid-way
