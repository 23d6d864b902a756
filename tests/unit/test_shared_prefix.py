"""livemoe.train.shared_prefix: the K completions of a prompt in one packed row give each token what its own padded
row gives (hidden states, router logits, log-probs) and the same gradients (fp32: sums in another order, 1e-5)."""
import random

import pytest
import torch

from livemoe.engine.model.loader import load_model
from livemoe.kernels.logprobs import fused_linear_logprobs
from livemoe.train.shared_prefix import forward_shared, pack_prompts
from tiny_models import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("m") / "ckpt", moe=True, seed=1)
    return load_model(path, dtype=torch.float32)


def rows(vocab: int, seed: int):
    """Two prompts (lengths 30 and 25) with 3 and 2 completions of 1-9 tokens, shuffled, right-padded (prompts long
    enough for sharing to pay: pack_prompts runs unshared otherwise)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (30, 25)]
    seqs = [(p, p + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 9))]) for p, k in zip(prompts, (3, 2))
            for _ in range(k)]
    rng.shuffle(seqs)
    T = max(len(s) for _, s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, (_, s) in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask, torch.tensor([len(p) for p, _ in seqs])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_prompt_forward_equals_the_padded_rows(model, seed):
    ids, mask, plens = rows(model.config.vocab_size, seed)
    shared = pack_prompts(ids, mask, plens)
    assert shared["input_ids"].shape[0] == 2  # one packed row per prompt
    assert shared["input_ids"].numel() < ids.numel()
    targets = ids[:, 1:]
    cmask = torch.zeros_like(targets, dtype=torch.bool)
    for i, p in enumerate(plens.tolist()):
        cmask[i, p - 1:int(mask[i].sum()) - 1] = True

    def run(shared_forward: bool):
        model.zero_grad()
        if shared_forward:
            hidden, router = forward_shared(model, shared)
        else:
            hidden, router = model.forward_hidden(ids, attention_mask=mask, return_router_logits=True)
        lp = fused_linear_logprobs(hidden[:, :-1], model.lm_head_weight, targets, 1.0, mask=cmask)
        real = mask.reshape(-1).bool()
        loss = (lp * cmask).sum() + sum((r[real] ** 2).mean() for r in router)  # router logits get a gradient too
        loss.backward()
        return lp.detach(), [r[real].detach() for r in router], {n: p.grad.clone() for n, p in model.named_parameters()
                                                                 if p.grad is not None}

    lp0, r0, g0 = run(False)
    lp1, r1, g1 = run(True)
    torch.testing.assert_close(lp1 * cmask, lp0 * cmask, rtol=1e-5, atol=1e-5)
    for a, b in zip(r0, r1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for k in g0:
        scale = float(g0[k].abs().max())
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-5 * scale + 1e-8, msg=k)


def test_no_shared_prompt_or_too_large_a_pattern_runs_unshared():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]])
    mask = (ids > 0).long()
    assert pack_prompts(ids, mask, torch.tensor([2, 2])) is None  # two different prompts
    same = torch.tensor([[1, 2, 3, 0], [1, 2, 6, 7]])
    assert pack_prompts(same, (same > 0).long(), torch.tensor([2, 2])) is not None
    assert pack_prompts(same, (same > 0).long(), torch.tensor([2, 2]), max_mask_elements=10) is None
    # long completions of a short prompt: one packed row of 2 + 8 x 30 tokens attends more than 8 rows of 32
    long = torch.cat([torch.tensor([[1, 2]]).expand(8, 2), torch.arange(3, 3 + 8 * 30).reshape(8, 30)], dim=1)
    assert pack_prompts(long, torch.ones_like(long), torch.full((8,), 2)) is None
    short = long[:, :6]  # 2 prompt tokens + 4 each: one row of 34 attends more (34^2) than 8 rows of 6 (8 x 6^2)
    assert pack_prompts(short, torch.ones_like(short), torch.full((8,), 2)) is None
    shared_prompt = torch.cat([torch.arange(1, 41).expand(8, 40), torch.arange(41, 41 + 16).reshape(8, 2)], dim=1)
    assert pack_prompts(shared_prompt, torch.ones_like(shared_prompt), torch.full((8,), 40)) is not None  # 56^2 < 8 x 42^2
