"""The rejection sampler (livemoe/kernels/rejection_sampler.py): the Triton kernels (under TRITON_INTERPRET=1 on the
CPU, compiled on a GPU) against the plain PyTorch rule, and the rule against its distribution.

Given the same uniforms and noise the rule is deterministic and the kernels do the same fp32 operations (subtract,
clamp, IEEE divide, first index on ties), so tokens and counts are asserted equal, not close."""
import pytest
import torch

from livemoe.kernels.rejection_sampler import rejection_sample_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(g: torch.Generator, lengths: list[int], V: int, drafts_from: str):
    """Probabilities, drafts (from q, from p, or uniform at random), uniforms and noise for sequences of
    lengths[b] rows (drafts + the bonus row)."""
    R = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    p = torch.rand(R, V, generator=g).pow(4)
    p /= p.sum(-1, keepdim=True)
    q = torch.rand(R, V, generator=g).pow(4)
    q /= q.sum(-1, keepdim=True)
    if drafts_from == "uniform":
        drafts = torch.randint(0, V, (R,), generator=g)
    else:
        drafts = torch.multinomial(q if drafts_from == "q" else p, 1, generator=g)[:, 0]
    u = torch.rand(R, generator=g)
    noise = torch.empty(R, V).exponential_(generator=g)
    return p, drafts, q, cu, u, noise


@pytest.mark.triton
@pytest.mark.parametrize("V", [5, 97, 1500])  # 1500: two vocabulary blocks, the second partial
@pytest.mark.parametrize("point_masses", [False, True])
@pytest.mark.parametrize("drafts_from", ["q", "p", "uniform"])
def test_triton_equals_the_reference(V, point_masses, drafts_from):
    from livemoe.kernels.rejection_sampler import rejection_sample_triton

    g = torch.Generator().manual_seed(V + 7 * point_masses + len(drafts_from))
    for lengths in ([1], [5, 1, 3], [2, 4, 4, 1, 5]):  # 1: a bonus row alone (no drafts)
        p, drafts, q, cu, u, noise = random_case(g, lengths, V, drafts_from)
        qq = None if point_masses else q
        want_tokens, want_n = rejection_sample_reference(p, drafts, qq, cu, u, noise)
        args = [t.to(DEVICE) if t is not None else None for t in (p, drafts, qq, cu, u, noise)]
        tokens, n = rejection_sample_triton(*args)
        assert torch.equal(tokens.cpu(), want_tokens) and torch.equal(n.cpu(), want_n), (tokens, want_tokens)


@pytest.mark.triton
def test_triton_keeps_what_the_rule_keeps_at_the_edges():
    """p == q (every draft kept, then the bonus), a draft q gives 0 (rejected), p of the draft 0 (rejected)."""
    from livemoe.kernels.rejection_sampler import rejection_sample_triton

    g = torch.Generator().manual_seed(3)
    p, drafts, q, cu, u, noise = random_case(g, [4, 3], 11, "q")
    cases = {"p == q": (p, p.clone()), "q(d) = 0": (p, q.scatter(1, drafts[:, None], 0.0)),
             "p(d) = 0": (p.scatter(1, drafts[:, None], 0.0), q)}
    for name, (pp, qq) in cases.items():
        want = rejection_sample_reference(pp, drafts, qq, cu, u, noise)
        got = rejection_sample_triton(*(t.to(DEVICE) for t in (pp, drafts, qq, cu, u, noise)))
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), name
        if name == "p == q":
            assert want[1].tolist() == [4, 3]
        else:
            assert want[1].tolist() == [1, 1] and not bool((want[0][:, 0] == drafts[[0, 4]]).any()), name


@pytest.mark.parametrize("point_masses", [False, True])
def test_reference_emits_the_target_distribution(point_masses):
    """The first token of one-draft sequences, drafts drawn from q (or fixed: a point mass), is distributed as p
    (chi-square at p = 0.001 over 6000 draws)."""
    from test_spec_decode import chi2_below_critical

    V, trials = 6, 6000
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g), -1)
    P = torch.stack([p, torch.full((V,), 1.0 / V)]).repeat(trials, 1)  # row 2 of each sequence: the bonus
    Q = torch.stack([q, torch.zeros(V)]).repeat(trials, 1)
    drafts = torch.full((2 * trials,), 2) if point_masses else \
        torch.multinomial(Q[::2], 1, generator=g)[:, 0].repeat_interleave(2)
    cu = torch.arange(0, 2 * trials + 1, 2, dtype=torch.int32)
    u = torch.rand(2 * trials, generator=g)
    noise = torch.empty(2 * trials, V).exponential_(generator=g)
    tokens, _ = rejection_sample_reference(P, drafts, None if point_masses else Q, cu, u, noise)
    counts = torch.bincount(tokens[:, 0], minlength=V).float()
    assert chi2_below_critical(counts, p)
