"""Supervised fine-tuning's pieces, shared by RFT (livemoe.train.rft) and MA-MSFT (livemoe.train.live.msft):
examples with per-token loss weights (0 on the prompt), length-bucketed epochs, right-padded batches, the
completion-only loss of one micro-batch with the MoE load-balancing term, the warm-up + cosine schedule, and
the held-out loss."""
import math
import random

import torch

from livemoe.train.data import build_prompt


def marker_token_ids(tokenizer, markers: str) -> list:
    ids = []
    for m in filter(None, (s.strip() for s in markers.split(","))):
        enc = tokenizer(m, add_special_tokens=False)["input_ids"]
        if len(enc) != 1:
            raise ValueError(f"--markers: {m!r} is {len(enc)} tokens in this tokenizer; a marker must be one token")
        ids.append(enc[0])
    return ids


def encode_example(rec: dict, tokenizer, max_len: int, marker_ids=(), marker_weight: float = 1.0):
    """input_ids, and per position the weight of predicting the NEXT token (0 on the prompt), or None
    when truncation to max_len leaves no completion token."""
    prompt = tokenizer(build_prompt(rec, tokenizer), add_special_tokens=False)["input_ids"]
    completion = tokenizer(rec["completion"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    ids = (prompt + completion)[:max_len]
    n_target = len(ids) - len(prompt)
    if n_target <= 0:
        return None
    weights = [0.0] * (len(prompt) - 1) + [marker_weight if t in marker_ids else 1.0 for t in ids[len(prompt):]]
    assert len(weights) == len(ids) - 1
    return {"input_ids": ids, "weights": weights}


def epoch_batches(lengths: list, batch_size: int, batching: str, seed: int) -> list:
    """Lists of example indices for one epoch; a pure function of its arguments (exact resume).
    bucket: shuffled, then sorted by length within windows of 32 batches, batches shuffled again."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if batching == "bucket":
        window = 32 * batch_size
        order = [i for w in range(0, len(order), window)
                 for i in sorted(order[w:w + window], key=lambda i: lengths[i])]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if batching == "bucket":
        rng.shuffle(batches)
    return batches


def collate(examples: list, pad_id: int, device) -> dict:
    """Right-padded input_ids [B, T], attention_mask [B, T], targets [B, T-1] (-100 = no loss), weights."""
    T = max(len(e["input_ids"]) for e in examples)
    B = len(examples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    weights = torch.zeros((B, T - 1))
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        mask[i, :n] = 1
        weights[i, : n - 1] = torch.tensor(e["weights"])
    targets = ids[:, 1:].masked_fill(weights == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "targets": targets.to(device),
            "weights": weights.to(device)}


def sft_step_loss(model, batch: dict, normalizer, lambda_aux: float, grad_accum: int, autocast, group=None,
                  forward=None) -> tuple:
    """(loss to backward, sft loss value, aux loss value) of one micro-batch.

    The completion-only loss is sum(w * -logprob) / normalizer, with normalizer the total weight of the
    whole accumulated step, so accumulation gives exactly the big-batch loss. `group`: the data-parallel
    ranks whose tokens the load-balancing loss counts (this rank's share is returned). `forward(batch)` ->
    (hidden, router logits) in place of the text forward (the live trainers' over media, livemoe.train.live.omni).
    """
    from livemoe.train.losses import sft_loss

    with autocast:
        if forward is None:
            hidden, router_logits = model.forward_hidden(batch["input_ids"], attention_mask=batch["attention_mask"],
                                                         return_router_logits=True)
        else:
            hidden, router_logits = forward(batch)
    loss = sft_loss(hidden[:, :-1].float(), model.lm_head_weight.float(), batch["targets"], batch["weights"],
                    normalizer=normalizer)
    aux = torch.zeros((), device=loss.device)
    if router_logits and lambda_aux > 0:
        aux = model.load_balancing_loss(router_logits, attention_mask=batch["attention_mask"], group=group)
    return loss + lambda_aux * aux / grad_accum, loss.detach(), aux.detach()


def make_scheduler(optimizer, warmup_steps: int, total_steps: int):
    """Linear warm-up to the peak lr, then cosine decay to 0 at total_steps."""
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def heldout_loss(model, examples: list, pad_id: int, batch_size: int, device, autocast) -> float:
    """The SFT loss (weighted mean over every completion token, no aux term) of `examples`."""
    model.eval()
    batches = [collate(examples[i:i + batch_size], pad_id, device) for i in range(0, len(examples), batch_size)]
    normalizer = sum(b["weights"][b["targets"] != -100].sum() for b in batches)
    loss = sum(sft_step_loss(model, b, normalizer, 0.0, 1, autocast)[1] for b in batches)
    model.train()
    return float(loss)
