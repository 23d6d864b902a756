"""What a request can ask to change in its logits before temperature and the filters: the grammar mask
(livemoe.engine.sampling.structured), min_tokens, logit_bias and the penalties, in that order, with vLLM's definitions:

  min_tokens          EOS and stop_token_ids get -inf while the output has fewer than min_tokens tokens
  logit_bias          logits[t] += bias[t]
  repetition_penalty  for each token t in the prompt or the output: logits[t] / p if logits[t] > 0,
                      logits[t] * p otherwise
  frequency_penalty   logits[t] -= f * (count of t in the output)
  presence_penalty    logits[t] -= p * (1 if t is in the output)

Their range checks are SamplingParams' own (params.py). A step where no row asks for any of them does
none of this work (`SamplingParams.processes_logits`,
computed once, is one attribute read per row); rows that ask nothing are left untouched when others do.
"""
import torch

from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.sampling.structured import apply_grammar_masks


def process_logits(logits: torch.Tensor, params: list[SamplingParams], seqs, eos_token_ids) -> torch.Tensor:
    """logits [B, V] fp32 -> the processed logits (a new tensor; rows that ask nothing are copies).
    seqs: per row, an object with token_ids, num_prompt_tokens and grammar (livemoe.engine.decoder.sequence.Sequence)."""
    out = logits.clone()
    B, V = logits.shape
    device = logits.device
    grammar_rows = [i for i in range(B) if params[i].structured is not None and seqs[i].grammar.active]
    if grammar_rows:
        apply_grammar_masks(out, grammar_rows, [seqs[i].grammar for i in grammar_rows])
    for i in range(B):
        p, seq = params[i], seqs[i]
        if p.min_tokens and len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens:
            banned = [t for t in ({*eos_token_ids} | set(p.stop_token_ids)) if t < V]
            out[i, banned] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if t < V], dtype=torch.long, device=device)
            out[i, ids] += torch.tensor([b for t, b in p.logit_bias.items() if t < V], device=device)
    rows = [i for i in range(B) if params[i].repetition_penalty != 1.0 or params[i].presence_penalty != 0.0
            or params[i].frequency_penalty != 0.0]
    if rows:
        sub = out[rows]
        prompt_ids = [seqs[i].token_ids[:seqs[i].num_prompt_tokens] for i in rows]
        output_ids = [seqs[i].token_ids[seqs[i].num_prompt_tokens:] for i in rows]
        num = lambda name: torch.tensor([getattr(params[i], name) for i in rows], device=device)  # noqa: E731
        out[rows] = apply_penalties(sub, prompt_ids, output_ids, num("repetition_penalty"),
                                    num("frequency_penalty"), num("presence_penalty"))
    return out


def _counts(ids: list[list[int]], V: int, device) -> torch.Tensor:
    """[R, V] counts of each token in each row's list."""
    counts = torch.zeros(len(ids), V + 1, device=device)  # column V: padding
    width = max((len(x) for x in ids), default=0)
    if width:
        index = torch.tensor([x + [V] * (width - len(x)) for x in ids], dtype=torch.long, device=device)
        counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :V]


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; per row its prompt and output ids and the three penalties [R]."""
    V = logits.shape[-1]
    out_counts = _counts(output_ids, V, logits.device)
    seen = (_counts(prompt_ids, V, logits.device) > 0) | (out_counts > 0)
    rep = torch.where(seen, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency[:, None] * out_counts - presence[:, None] * (out_counts > 0).float()
