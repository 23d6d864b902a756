"""What MA-MSFT's and SM-GSPO's options share: the optimizer step's aux loss, clipping, seed and the
non-finite guard (one default each; `python -m train.live` has one flag for both stages), and the checks
both stages' options run when they are made (an OptionError names the bad field)."""
from dataclasses import dataclass

from livemoe.train.config import OptionError


@dataclass(kw_only=True)
class StageOptions:
    lambda_aux: float = 0.01  # the MoE load-balancing loss's weight (the seed's λ_aux)
    max_grad_norm: float = 1.0
    seed: int = 0
    max_nonfinite_steps: int = 5
    # a Qwen3-Omni-MoE thinker: its encoders stay frozen; True also trains their projectors (livemoe.train.live.omni)
    train_projector: bool = False

    def __post_init__(self):
        if not self.lambda_aux >= 0:
            raise OptionError("lambda_aux", f"must be >= 0, got {self.lambda_aux}")

    def check_at_least(self, low, *names: str) -> None:
        for name in names:
            if getattr(self, name) < low:
                raise OptionError(name, f"must be >= {low}, got {getattr(self, name)}")

    def check_positive(self, *names: str) -> None:
        for name in names:
            if not getattr(self, name) > 0:
                raise OptionError(name, f"must be > 0, got {getattr(self, name)}")

    def check_fraction(self, *names: str) -> None:
        for name in names:
            if not 0 <= getattr(self, name) <= 1:
                raise OptionError(name, f"must be in [0, 1], got {getattr(self, name)}")

    def check_choice(self, name: str, choices: tuple) -> None:
        if getattr(self, name) not in choices:
            raise OptionError(name, f"must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
