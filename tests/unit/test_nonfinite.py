"""The trainers' guard against non-finite steps: skipped, counted, and a run that keeps producing them stops."""
import pytest
import torch

from livemoe.train.config import ConfigError
from livemoe.train.rft.config import RFTConfig
from livemoe.train.nonfinite import NonFiniteError, NonFiniteGuard


def setup():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    return lin, torch.optim.SGD(lin.parameters(), lr=0.1)


def test_a_nonfinite_step_is_skipped_and_counted():
    lin, opt = setup()
    guard = NonFiniteGuard(3)
    before = lin.weight.detach().clone()
    lin.weight.sum().backward()
    assert not guard.step(opt, float("nan"), 1.0, "step 1")
    assert torch.equal(lin.weight, before) and lin.weight.grad is None  # no update, gradients dropped
    lin.weight.sum().backward()
    assert not guard.step(opt, 0.5, float("inf"), "step 2")
    assert (guard.skipped, guard.in_a_row) == (2, 2)
    lin.weight.sum().backward()
    assert guard.step(opt, 0.5, 1.0, "step 3")
    assert not torch.equal(lin.weight, before) and (guard.skipped, guard.in_a_row) == (2, 0)


def test_too_many_in_a_row_stop_the_run():
    _, opt = setup()
    guard = NonFiniteGuard(2)
    for where in ("step 1", "step 3"):  # a finite step in between resets the streak
        guard.step(opt, float("nan"), 1.0, where)
        guard.step(opt, 1.0, 1.0, "ok")
    guard.step(opt, float("nan"), 1.0, "step 5")
    with pytest.raises(NonFiniteError, match=r"step 6: the loss or the gradients were NaN/Inf in 2 steps in a row "
                                             r"\(--max_nonfinite_steps 2\)"):
        guard.step(opt, 1.0, float("nan"), "step 6")
    assert guard.skipped == 4


def test_max_nonfinite_steps_is_validated(tmp_path):
    assert RFTConfig(output_dir=str(tmp_path)).max_nonfinite_steps == 5
    with pytest.raises(ConfigError, match="--max_nonfinite_steps must be >= 1, got 0"):
        RFTConfig(output_dir=str(tmp_path), max_nonfinite_steps=0).validate()
