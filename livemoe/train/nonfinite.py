"""The guard both trainers put around `optimizer.step()`: a step whose loss or gradient norm is NaN/Inf
is skipped (the gradients are dropped, the weights stay as they were) and counted; `max_in_a_row` such
steps in a row end the run with NonFiniteError (a ValueError: the trainer CLIs print it and exit 2).
Together with the checkpoint and export checks (livemoe.train.checkpoint, engine.save_model), a diverged run
never saves or exports non-finite weights and its last good checkpoint is kept."""
import math


class NonFiniteError(ValueError):
    """A run that keeps producing non-finite losses or gradients."""


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int, skipped: int = 0):
        assert max_in_a_row >= 1
        self.max_in_a_row = max_in_a_row
        self.skipped = skipped  # steps skipped over the whole run (kept in the checkpoints)
        self.in_a_row = 0

    def step(self, optimizer, loss, grad_norm, where: str) -> bool:
        """optimizer.step() when loss and grad_norm are finite -> True; otherwise drops the gradients,
        counts the step -> False, and raises NonFiniteError once max_in_a_row steps in a row were skipped."""
        loss, grad_norm = float(loss), float(grad_norm)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            optimizer.step()
            self.in_a_row = 0
            return True
        optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        self.in_a_row += 1
        print(f"[nonfinite] {where}: loss {loss}, gradient norm {grad_norm}: optimizer step skipped "
              f"({self.in_a_row} in a row, at most {self.max_in_a_row})", flush=True)
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(f"{where}: the loss or the gradients were NaN/Inf in {self.in_a_row} steps in a "
                                 f"row (--max_nonfinite_steps {self.max_in_a_row}); the run diverged (is --lr too "
                                 "high?). No checkpoint or export holds non-finite weights; the last good "
                                 "checkpoint is kept (--resume auto continues from it)")
        return False
