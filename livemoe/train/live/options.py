"""What MA-MSFT's and SM-GSPO's options share: the optimizer step's aux loss, clipping, seed and the
non-finite guard (one default each; `python -m train.live` has one flag for both stages)."""
from dataclasses import dataclass


@dataclass(kw_only=True)
class StageOptions:
    lambda_aux: float = 0.01  # the MoE load-balancing loss's weight (the seed's λ_aux)
    max_grad_norm: float = 1.0
    seed: int = 0
    max_nonfinite_steps: int = 5
