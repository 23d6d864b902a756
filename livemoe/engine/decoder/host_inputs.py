"""HostInputs: a CPU runner's step inputs in buffers kept across steps.

A CPU decode step at batch 1 costs a few microseconds per torch call; making its inputs from a StepPlan's two arrays
took two tensors and five views a step. Here the arrays are copied (numpy, in place) into two buffers the runner
keeps, and a decode step's views of them, which depend only on (sequences, block-table width), are kept too. A CPU
step is done with its inputs when ModelRunner.execute returns, so the next step may overwrite them.
"""
import numpy as np
import torch

from livemoe.engine.decoder.step_plan import StepPlan

# (sequences, width) shapes whose views are kept at most: a decode batch's sizes, bounded anyway by max_num_seqs and
# the longest block table
_MAX_SHAPES = 1024


class HostInputs:
    def __init__(self):
        self.longs = torch.empty(0, dtype=torch.long)
        self.ints = torch.empty(0, dtype=torch.int32)
        self._longs_np = self.longs.numpy()
        self._ints_np = self.ints.numpy()
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def views(self, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        """(input_ids [N], positions [N], slot_mapping [N], context_lens [S], cu_seqlens_q [S + 1], block_tables
        [S, width]) of the plan, as views of the kept buffers, which now hold its values."""
        n_longs, n_ints = len(plan.longs), len(plan.ints)
        if n_longs > self.longs.numel() or n_ints > self.ints.numel():
            self._grow(n_longs, n_ints)
        self._longs_np[:n_longs] = np.frombuffer(plan.longs, dtype=np.int64)
        self._ints_np[:n_ints] = np.frombuffer(plan.ints, dtype=np.int32)
        key = (plan.num_seqs, plan.width)
        if plan.is_decode and (kept := self._views.get(key)) is not None:
            return kept
        views = plan.split(self.longs[:n_longs], self.ints[:n_ints])
        if plan.is_decode:  # N == S: the views depend on (S, width) alone
            if len(self._views) >= _MAX_SHAPES:
                self._views.clear()
            self._views[key] = views
        return views

    def _grow(self, n_longs: int, n_ints: int) -> None:
        """Larger buffers (twice what is asked: prefill steps vary); the views of the old ones are dropped."""
        self.longs = torch.empty(max(2 * n_longs, self.longs.numel()), dtype=torch.long)
        self.ints = torch.empty(max(2 * n_ints, self.ints.numel()), dtype=torch.int32)
        self._longs_np = self.longs.numpy()
        self._ints_np = self.ints.numpy()
        self._views.clear()
