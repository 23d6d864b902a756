"""draft_model: a smaller checkpoint with the target's tokenizer drafts k tokens autoregressively, in the same
engine, with a paged KV cache of its own. Its cache has the target's block size and block count and is indexed by
the target's block tables, so it needs no block manager: a sequence's blocks hold the target's K/V in one cache and
the draft's in the other. `seq.num_draft_computed` counts the tokens whose draft K/V are written; a proposal first
catches the draft up (the whole prompt the first time, afterwards the one or two tokens the last verification
added), then runs k - 1 one-token steps. After a verification only the accepted positions stay counted.

Drafts are drawn from the draft's own distribution under the request's temperature and filters (no logits
processors: a processed target rejects what they would forbid), and returned with it, so verification applies
min(1, p/q). Greedy requests take the draft's argmax. The draft runs eagerly (no CUDA graphs).
"""
import dataclasses

import torch

from livemoe.engine.decoder.config import EngineConfig
from livemoe.engine.decoder.model_runner import ModelRunner
from livemoe.engine.decoder.scheduler import SchedulerOutput
from livemoe.engine.decoder.sequence import Sequence
from livemoe.engine.decoder.spec.proposers import Proposer
from livemoe.engine.errors import EngineConfigError
from livemoe.engine.sampling.sampler import Sampler


@dataclasses.dataclass(slots=True)
class _DraftView:
    """What ModelRunner.plan reads of a sequence, for one draft forward."""
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    num_draft_tokens: int = 0
    media = None  # a draft model reads text only: its steps take no media
    rope_delta = 0

    def __len__(self) -> int:
        return len(self.token_ids)


def check_compatible(target_model, target_tokenizer, draft_model, draft_tokenizer, draft_path: str) -> None:
    """A draft must speak the target's vocabulary: the same size and, where both ship one, the same tokenizer."""
    tv, dv = target_model.config.vocab_size, draft_model.config.vocab_size
    if tv != dv:
        raise EngineConfigError(f"speculative_config: the draft model {draft_path} has vocab_size {dv}, the target "
                                f"{tv}: a draft must share the target's vocabulary")
    if (target_tokenizer is None) != (draft_tokenizer is None) or (
            target_tokenizer is not None and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab()):
        raise EngineConfigError(f"speculative_config: the draft model {draft_path} has another tokenizer than the "
                                f"target: a draft must use the target's")


class DraftModelProposer(Proposer):
    def __init__(self, model, config: EngineConfig, max_model_len: int, sampler: Sampler):
        # the draft's runner: eager, the target's block size (its cache is indexed by the target's block tables)
        draft_config = dataclasses.replace(config, enforce_eager=True, speculative_config=None)
        self.runner = ModelRunner(model, draft_config, max_model_len)
        self.sampler = sampler
        self.block_manager = None  # the target's, set with the cache (allocate)

    @property
    def block_bytes(self) -> int:
        return self.runner.block_bytes

    def allocate(self, num_blocks: int, block_manager) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = block_manager

    def free(self) -> None:
        self.runner.free_kv_cache()
        self.block_manager = None

    def propose(self, seqs: list[Sequence], limits: list[int]):
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(seqs)
        bm = self.block_manager
        assert bm is not None and self.runner.kv_cache is not None, "the draft's KV cache is not allocated"
        # slots for the draft's own positions (len - 1 .. len + k - 2) and the verification's: the target's blocks
        active = [i for i, (seq, k) in enumerate(zip(seqs, limits)) if k > 0 and bm.try_append_slots(seq, 1 + k)]
        if not active:
            return out
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for step in range(max(limits[i] for i in active)):
            rows = [i for i in active if len(drafts[i]) < limits[i]]
            if not rows:
                break
            views, counts = [], []
            for i in rows:
                seq = seqs[i]
                tokens = seq.token_ids + drafts[i]
                start = seq.num_draft_computed if step == 0 else len(tokens) - 1
                views.append(_DraftView(tokens, start, seq.block_table))
                counts.append(len(tokens) - start)
            logits, _ = self.runner.run(SchedulerOutput(views, counts))  # views: what plan() reads of a Sequence
            for j, i in enumerate(rows):
                seqs[i].num_draft_computed = views[j].num_computed_tokens + counts[j]
            params = [seqs[i].params for i in rows]
            d = self.sampler.distributions(logits, params)
            sampled = [j for j, p in enumerate(params) if not p.greedy]
            tokens = d.filtered.argmax(-1)
            if sampled:
                q = d.filtered[sampled].softmax(-1)
                tokens[sampled] = self.sampler.draw(q, [seqs[rows[j]].generator for j in sampled])
                for j, row in zip(sampled, q):
                    probs[rows[j]].append(row)
            for j, i in enumerate(rows):
                drafts[i].append(int(tokens[j]))
        for i in active:
            out[i] = (drafts[i], torch.stack(probs[i]) if probs[i] else None)
        return out
