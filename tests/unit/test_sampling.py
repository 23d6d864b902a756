"""SamplingParams validation and the Sampler: exact kept sets of top-k / top-p / min-p, seeded
reproducibility independent of the batch, the sampled distribution, and raw vs processed logprobs."""
import math

import pytest
import torch

from livemoe.engine.sampling.sampler import Sampler, argmax_tokens, filter_logits
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.errors import RequestError

# probabilities 0.4, 0.3, 0.2, 0.1 at shuffled token ids (margins far from float rounding)
PROBS = {7: 0.4, 2: 0.3, 5: 0.2, 0: 0.1}
V = 8


def logits_row():
    row = torch.full((V,), float("-inf"))
    for t, p in PROBS.items():
        row[t] = math.log(p)
    return row


def kept(top_k=0, top_p=1.0, min_p=0.0):
    out = filter_logits(logits_row()[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist())


@pytest.mark.parametrize("kw,expected", [
    (dict(), {7, 2, 5, 0}),
    (dict(top_k=1), {7}),
    (dict(top_k=2), {7, 2}),
    (dict(top_k=100), {7, 2, 5, 0}),
    (dict(top_p=0.35), {7}),
    (dict(top_p=0.45), {7, 2}),  # 0.4 < 0.45: token 2 crosses top_p and is kept
    (dict(top_p=0.75), {7, 2, 5}),
    (dict(top_p=0.95), {7, 2, 5, 0}),
    (dict(top_k=3, top_p=0.5), {7, 2}),  # after top-k: 0.44, 0.33, 0.22 -> 0.44 < 0.5 keeps token 2
    (dict(top_k=3, top_p=0.4), {7}),  # 0.44 >= 0.4
    (dict(min_p=0.5), {7, 2, 5}),  # p >= 0.2
    (dict(min_p=0.6), {7, 2}),  # p >= 0.24
    (dict(top_p=0.75, min_p=0.6), {7, 2}),
])
def test_filters_keep_exact_set(kw, expected):
    assert kept(**kw) == expected


def test_filters_are_per_row():
    logits = torch.stack([logits_row(), logits_row()])
    out = filter_logits(logits, torch.tensor([1, 0]), torch.tensor([1.0, 0.45]), torch.tensor([0.0, 0.0]))
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == {7}
    assert set(torch.nonzero(torch.isfinite(out[1])).flatten().tolist()) == {7, 2}


@pytest.mark.parametrize("kw", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
    dict(top_k=1.5), dict(min_p=-0.1), dict(min_p=2.0), dict(max_tokens=0), dict(n=0), dict(logprobs=-1),
    dict(logprobs_mode="weird"), dict(stop=[""]), dict(stop_token_ids=[-1]), dict(seed=-3), dict(max_tokens=True),
    # non-finite, or integers the engine's int64 tensors and generator seeds cannot hold
    dict(temperature=float("inf")), dict(temperature=10**400), dict(seed=2**63), dict(seed=2**64),
    dict(seed=2**63 - 2, n=3), dict(top_k=2**63), dict(max_tokens=2**64), dict(logprobs=2**63),
    dict(stop_token_ids=[2**63]), dict(n=2**64),
])
def test_invalid_params_rejected(kw):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert isinstance(e.value, ValueError) and str(e.value).startswith("SamplingParams:")


def test_largest_integers_the_engine_holds_are_accepted():
    p = SamplingParams(seed=2**63 - 3, n=3, top_k=2**63 - 1, temperature=0.7, logprobs=1)
    gens = [torch.Generator().manual_seed(p.seed + i) for i in range(p.n)]  # what the engine makes
    logits = torch.randn(3, V)
    out = Sampler()(logits, [p] * 3, gens)
    assert len(out.token_ids) == 3 and all(0 <= t < V for t in out.token_ids)


@pytest.mark.parametrize("temperature", [1e-5 / 2, 1e-38, 1e-45, 1e-50])
def test_too_small_temperature_is_greedy(temperature):
    """Dividing by these overflowed to NaN (token 0, NaN logprobs) or sampled at random; now they decode
    as temperature 0 does, with the same (finite) raw logprobs."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 5
    tiny = SamplingParams(temperature=temperature, logprobs=2)
    assert tiny.greedy
    greedy = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2)] * 4, [None] * 4)
    got = Sampler()(logits, [tiny] * 4, [None] * 4)
    assert got.token_ids == logits.argmax(-1).tolist() == greedy.token_ids
    assert got.logprobs == greedy.logprobs and all(math.isfinite(v) for lp in got.logprobs for v in lp.values())
    assert not SamplingParams(temperature=1e-5).greedy  # the threshold itself samples


def test_stop_string_is_listed():
    assert SamplingParams(stop="x").stop == ["x"]


def seeded_tokens(batch_rows, seed_row, steps=6):
    """Samples `steps` tokens for the seeded row placed at seed_row among batch_rows rows."""
    logits = torch.randn(batch_rows, 50, generator=torch.Generator().manual_seed(batch_rows))
    logits[seed_row] = torch.randn(50, generator=torch.Generator().manual_seed(123))
    sampler = Sampler(seed=99)
    params = [SamplingParams(temperature=0.8) for _ in range(batch_rows)]
    params[seed_row] = SamplingParams(temperature=1.3, top_k=20, seed=7)
    gen = torch.Generator().manual_seed(7)
    gens = [None] * batch_rows
    gens[seed_row] = gen
    out = []
    for _ in range(steps):
        out.append(sampler(logits, params, gens).token_ids[seed_row])
    return out


def test_seeded_sampling_independent_of_batch():
    alone = seeded_tokens(1, 0)
    in_batch = seeded_tokens(5, 3)
    assert alone == in_batch
    again = seeded_tokens(5, 3)
    assert again == in_batch
    assert len(set(alone)) > 1  # really sampling, not argmax


def test_sampled_distribution_matches_filtered_probs():
    n = 4000
    logits = logits_row()[None].repeat(n, 1)
    params = [SamplingParams(temperature=1.0, top_k=3)] * n
    tokens = torch.tensor(Sampler(seed=1)(logits, params, [None] * n).token_ids)
    freq = {t: (tokens == t).float().mean().item() for t in range(V)}
    expect = {7: 0.4 / 0.9, 2: 0.3 / 0.9, 5: 0.2 / 0.9}
    assert set(tokens.tolist()) == set(expect)
    for t, p in expect.items():
        assert abs(freq[t] - p) < 0.03, (t, freq[t], p)  # ~4 sigma at n=4000


def test_greedy_and_temperature_scaling():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert Sampler()(logits, [SamplingParams(temperature=0)], [None]).token_ids == [1]
    # a tiny temperature makes sampling effectively greedy
    assert Sampler()(logits, [SamplingParams(temperature=1e-4)], [None]).token_ids == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_argmax_tokens_is_torch_argmax(dtype, rows):
    """The one greedy path: torch's argmax (ties to the first maximum, a NaN row to its NaN) and, for CPU fp32
    logits, the batch's max as logits.amax() gives it (NaN and +inf included); the Sampler's greedy rows take it."""
    g = torch.Generator().manual_seed(rows)
    logits = torch.randint(-3, 4, (rows, 50), generator=g).to(dtype)  # many tied maxima
    if rows > 1:
        logits[1, 7] = float("nan")
        logits[2, 3] = float("inf")
    tokens, batch_max = argmax_tokens(logits)
    assert tokens == logits.argmax(-1).tolist()
    if dtype == torch.float32:
        assert batch_max is not None
        expected = logits.amax().item()
        assert (math.isnan(batch_max) and math.isnan(expected)) or batch_max == expected
    else:
        assert batch_max is None
    params = [SamplingParams(temperature=0)] * rows
    assert Sampler()(logits, params, [None] * rows).token_ids == tokens


def test_logprobs_raw_and_processed():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    gen = torch.Generator().manual_seed(0)
    raw = Sampler()(logits, [SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=0)], [gen])
    tok = raw.token_ids[0]
    assert tok in (0, 1)
    expect_raw = (logits[0] / 0.5).log_softmax(-1)
    lp = raw.logprobs[0]
    assert list(lp)[0] == tok and len(lp) == 3
    for t, v in lp.items():
        assert v == pytest.approx(expect_raw[t].item(), abs=1e-6)
    gen = torch.Generator().manual_seed(0)
    proc = Sampler()(logits, [SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=0,
                                             logprobs_mode="processed")], [gen])
    assert proc.token_ids == raw.token_ids
    expect_proc = (logits[0, :2] / 0.5).log_softmax(-1)
    lp = proc.logprobs[0]
    assert lp[0] == pytest.approx(expect_proc[0].item(), abs=1e-6)
    assert lp[1] == pytest.approx(expect_proc[1].item(), abs=1e-6)
    assert len(lp) == 3 and all(v == float("-inf") for t, v in lp.items() if t > 1)  # outside the kept set
    # greedy logprobs are log_softmax of the raw logits
    g = Sampler()(logits, [SamplingParams(temperature=0, logprobs=0)], [None])
    assert g.logprobs[0] == {0: pytest.approx(logits[0].log_softmax(-1)[0].item(), abs=1e-6)}
