"""fp32 master weights for a module that computes in bf16 on one device: FSDP2's MixedPrecisionPolicy
(livemoe.train.parallel.parallelize) without the sharding.

The module holds bf16 parameters (what the forward, the backward and the rollout decoder read, so decoding stays
as fast as today); the optimizer holds fp32 copies (the master weights) and its AdamW states in fp32. Each bf16
gradient is added into its master's fp32 gradient as soon as backward produced it (and dropped), so gradient
accumulation over micro-batches sums in fp32; after optimizer.step() the masters are rounded into the module.

Why: at lr 2.5e-6 an AdamW update of a weight ~N(0, 0.02) is ~2.5e-6, below half a bf16 ulp of most weights
(2^-8 relative: ~4e-5 at 0.01), so bf16 weights updated in place barely move (about 4% of them in 10 steps);
the fp32 masters move every step, and the rounded bf16 copy follows once the change is a bf16 step.
"""
import contextlib

import torch
from torch import nn


class MasterWeights:
    def __init__(self, model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16):
        """Keeps the fp32 storage of model's trainable parameters as the masters (no copy) and gives every
        parameter of the module a compute_dtype copy, in place (buffers, such as rotary tables, stay as built:
        the module is then what engine.load_model(dtype=compute_dtype) builds)."""
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        bad = [(n, p.dtype) for n, p in named if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"fp32 master weights are taken from an fp32 model; parameter {bad[0][0]!r} is {bad[0][1]}")
        self.params = [p for _, p in named]
        self.masters = [p.detach().requires_grad_(True) for p in self.params]
        for p in model.parameters():
            p.data = p.data.to(compute_dtype)
        for p, m in zip(self.params, self.masters):
            p.register_post_accumulate_grad_hook(self._accumulate_into(m))

    @staticmethod
    def _accumulate_into(master: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)
            p.grad = None  # the bf16 gradient lives only until it is summed in fp32
        return hook

    def parameters(self) -> list:
        """The fp32 masters: what the optimizer updates and gradient clipping reads."""
        return self.masters

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The masters rounded into the module's bf16 parameters (after each optimizer step)."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    @contextlib.contextmanager
    def fp32_model(self):
        """The module holding the fp32 masters themselves, for a checkpoint or an export (so a resumed run
        continues from the exact masters); back to bf16 after."""
        low = [p.data for p in self.params]
        try:
            for p, m in zip(self.params, self.masters):
                p.data = m.detach()
            yield self.model
        finally:
            for p, t in zip(self.params, low):
                p.data = t
