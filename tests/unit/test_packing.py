"""livemoe.train.packing: token-balanced micro-batches cover every row once and keep within the budget."""
import random

import pytest

from livemoe.train.packing import token_balanced_groups


@pytest.mark.parametrize("seed", range(5))
def test_groups_cover_every_row_once_within_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    budget = rng.randint(50, 1200)
    groups = token_balanced_groups(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= budget or len(g) == 1  # a too-long row goes alone
    assert groups == token_balanced_groups(lengths, budget)  # a pure function of the lengths


def test_short_rows_share_a_micro_batch_and_long_ones_go_alone():
    assert token_balanced_groups([10, 100, 12, 11, 90], 100) == [[1], [4], [2, 3, 0]]
    assert token_balanced_groups([], 10) == []
    with pytest.raises(ValueError, match="max_tokens"):
        token_balanced_groups([1], 0)
