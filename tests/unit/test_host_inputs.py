"""HostInputs (livemoe.engine.decoder.host_inputs): a CPU runner's step inputs, copied into kept buffers, equal the
plan's arrays read directly, across decode and prefill steps, kept views and buffer growth."""
import array
import random

import torch

from livemoe.engine.decoder.host_inputs import HostInputs
from livemoe.engine.decoder.step_plan import StepPlan


def random_plan(rng: random.Random, S: int, q: int, width: int) -> StepPlan:
    N = S * q
    longs = array.array("q", [rng.randrange(-1, 10**6) for _ in range(3 * N)])
    ints = array.array("i", [rng.randrange(-1, 10**6) for _ in range(2 * S + 1 + S * width)])
    return StepPlan(longs=longs, ints=ints, sample_rows=list(range(N)), num_seqs=S, width=width, max_seqlen_q=q,
                    is_decode=q == 1, max_context_len=1)


def expected(plan: StepPlan) -> list[torch.Tensor]:
    S, N, w = plan.num_seqs, plan.num_tokens, plan.width
    longs = torch.tensor(plan.longs.tolist(), dtype=torch.long)
    ints = torch.tensor(plan.ints.tolist(), dtype=torch.int32)
    return [longs[:N], longs[N:2 * N], longs[2 * N:], ints[:S], ints[S:2 * S + 1], ints[2 * S + 1:].view(S, w)]


def test_views_hold_each_plans_values():
    rng = random.Random(0)
    host = HostInputs()
    # decode steps at kept shapes, prefill steps between them, and plans larger than the buffers (growth)
    shapes = [(1, 1, 2), (1, 1, 2), (3, 1, 4), (2, 7, 3), (1, 1, 2), (3, 1, 4), (64, 1, 9), (5, 40, 12), (1, 1, 2)]
    for S, q, width in shapes:
        plan = random_plan(rng, S, q, width)
        got = host.views(plan)
        for g, e in zip(got, expected(plan), strict=True):
            assert g.dtype == e.dtype and g.shape == e.shape
            assert torch.equal(g, e)
