"""Prompt log-probs (`SamplingParams.prompt_logprobs`): each prompt token's log-prob given the tokens before it,
taken from the prefill's own hidden states as the chunks run, so a long prompt costs one more lm_head pass over
its rows and never a [prompt_len, vocab] logits tensor.

A request that asks computes its whole prompt: its first sequence takes no prefix-cache hit (a cached block has
K/V but no hidden states to read logits from), while the blocks it computes still enter the cache for others.
The values are the model's distribution, log_softmax(logits) without temperature or filters (vLLM's), in fp32:
the token's own log-prob through the fused log-prob kernel (never [rows, V]); with top-k, logits over row
chunks of at most CHUNK_BYTES. The engine core calls `PromptLogprobs.collect` after each forward that holds
rows of such a prompt.
"""
import torch

from livemoe.engine.decoder.scheduler import SchedulerOutput
from livemoe.engine.decoder.sequence import Request, Sequence
from livemoe.kernels.logprobs import fused_linear_logprobs

CHUNK_BYTES = 32 << 20  # fp32 logits of one row chunk when top-k is asked (logsumexp takes as much again)


class _Pending:
    """One request's prompt log-probs being filled, by position (a preempted sequence recomputes: rewrites)."""

    def __init__(self, req: Request, k: int):
        self.req, self.k = req, k  # k: the top-k asked
        n = len(req.prompt_ids) - 1  # position p predicts token p + 1
        self.values: list[dict[int, float] | None] = [None] * n
        self.missing = n


class PromptLogprobs:
    def __init__(self, model):
        self.model = model
        self.pending: dict[int, _Pending] = {}  # seq_id of the sequence that computes them -> its request's

    def add(self, req: Request) -> None:
        """Called as the request enters the engine; its first sequence computes the whole prompt."""
        k = req.params.prompt_logprobs
        if k is None:
            return
        seq = req.seqs[0]
        entry = _Pending(req, k)
        if entry.missing == 0:  # a one-token prompt: nothing to predict
            req.prompt_logprobs = [None]
            return
        seq.uncached_prefill = True
        self.pending[seq.seq_id] = entry

    def discard(self, seq: Sequence) -> None:
        """The sequence ended (aborted or failed) before its prompt was done."""
        self.pending.pop(seq.seq_id, None)

    def wanted(self, out: SchedulerOutput) -> bool:
        """Whether this step computes rows of a pending prompt (then the runner keeps its hidden states)."""
        return bool(self.pending) and any(seq.seq_id in self.pending for seq in out.seqs)

    @torch.inference_mode()
    def collect(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """After the forward of `out` (before its computed tokens are counted): the log-probs its pending prompts'
        rows give. hidden: [num_tokens, H], the step's rows in scheduling order."""
        rows, targets, where = [], [], []
        row = 0
        for seq, n in zip(out.seqs, out.num_new_tokens):
            entry = self.pending.get(seq.seq_id)
            start = seq.num_computed_tokens
            if entry is not None:
                for p in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                    rows.append(row + p - start)
                    targets.append(seq.token_ids[p + 1])
                    where.append((seq.seq_id, p))
            row += n
        if not rows:
            return
        k = max(self.pending[seq_id].k for seq_id, _ in where)
        h = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device))
        tgt = torch.tensor(targets, dtype=torch.long, device=hidden.device)
        token_lp, top_ids, top_lp = self.compute(h, tgt, k)
        token_lp, top_ids, top_lp = token_lp.tolist(), top_ids.tolist(), top_lp.tolist()
        for i, (seq_id, p) in enumerate(where):
            entry = self.pending[seq_id]
            lp = {targets[i]: token_lp[i]}  # the prompt token first, then the top-k (as sampled logprobs)
            for t, v in zip(top_ids[i][:entry.k], top_lp[i][:entry.k]):
                lp.setdefault(t, v)
            if entry.values[p] is None:
                entry.missing -= 1
            entry.values[p] = lp
            if entry.missing == 0:
                entry.req.prompt_logprobs = [None, *entry.values]
                del self.pending[seq_id]
                for seq in entry.req.seqs:
                    seq.uncached_prefill = False  # done: a later recompute may use the cache again

    def compute(self, hidden: torch.Tensor, targets: torch.Tensor, k: int):
        """(token log-probs [R], top-k ids [R, k], top-k log-probs [R, k]), fp32 log_softmax of the logits."""
        weight = self.model.lm_head_weight
        if k == 0:
            empty = torch.empty(len(targets), 0)
            return fused_linear_logprobs(hidden, weight, targets).float().cpu(), empty.long(), empty
        chunk = max(1, CHUNK_BYTES // (4 * weight.shape[0]))
        parts = []
        for r0 in range(0, hidden.shape[0], chunk):
            logits = self.model.compute_logits(hidden[r0:r0 + chunk]).float()
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (no second [rows, V] as log_softmax makes)
            top = logits.max(-1, keepdim=True) if k == 1 else logits.topk(min(k, logits.shape[-1]), dim=-1)
            token = logits.gather(-1, targets[r0:r0 + chunk, None])
            parts.append(((token - lse)[:, 0], top.indices, top.values - lse))
        return tuple(torch.cat(x).cpu() for x in zip(*parts))
