"""MA-MSFT: marker-aware multi-turn SFT over whole session trajectories.

One training sequence is one session in the live layout (livemoe.engine.live.layout), and the loss is on every
interval's decision tokens (the end token included); events and the system prompt carry no loss. The
decisions are the recorded trajectory's (livemoe.train.live.world.recorded_decision: what the recording did, which
may leave out what the reviewed decision makes); the judge scores against the reviewed ones. Two
weights shape it, per predicted token:
  marker weight  the decision's marker and field tokens (the kind word, the "@", the task and the
                 ":" before the message, and the end token) weigh `marker_weight`; message tokens 1.
                 These few tokens decide the state and the task, and are swamped by the message's
                 tokens otherwise.
  recipient weight  the recipient name's tokens (after "ANS @") weigh `recipient_weight`: the name is
                 copied from the events (a join, a gift, the question's comment, perhaps intervals
                 back), an in-context copy the tiny student learns last, and one interval in three
                 is an ANS whose recipient is scored.
  balance        each interval's tokens are scaled by its gold kind's class weight
                 (N / (K * n_kind)) ** balance over the training intervals (K kinds present), so the
                 rare MEM and ANS intervals count as much as the frequent OBS (balance 1) or as in the
                 data (balance 0).
marker_weight = recipient_weight = 1 and balance = 0 is plain multi-turn SFT. The loss is livemoe.train.sft's (RFT's): sum(w * -logprob) /
sum(w) through the fused log-probs, with the MoE load-balancing term.
"""
import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass

import torch

from livemoe.engine.live.decision import KINDS
from livemoe.train.live import omni
from livemoe.train.live.data import encode_session
from livemoe.train.live.options import StageOptions
from livemoe.train.live.world import decision_text, recorded_decision
from livemoe.train.nonfinite import NonFiniteGuard
from livemoe.train.sft import collate, make_scheduler, sft_step_loss


@dataclass(kw_only=True)
class MSFTOptions(StageOptions):
    marker_weight: float = 3.0
    recipient_weight: float = 10.0
    balance: float = 1.0
    lr: float = 5e-3
    steps: int = 500
    batch_size: int = 4
    warmup_steps: int = 10
    max_len: int = 1024

    def __post_init__(self):
        super().__post_init__()
        self.check_at_least(1, "steps", "batch_size", "max_len")
        self.check_positive("lr", "marker_weight", "recipient_weight")
        self.check_fraction("balance")


def class_weights(kinds: list, balance: float) -> dict:
    """kind -> (N / (K * n_kind)) ** balance over the given interval kinds."""
    counts = Counter(kinds)
    n, k = sum(counts.values()), len(counts)
    return {kind: (n / (k * c)) ** balance for kind, c in counts.items()}


def field_chars(text: str) -> int:
    """How many leading characters of a decision are its marker and fields (all of it but the message)."""
    if text.startswith("ANS"):
        return text.index(": ", 4) + 2
    if text.startswith("MEM"):
        return 4
    return len(text)


def recipient_chars(text: str) -> tuple:
    """(start, end) of the recipient name in a decision's text ((0, 0) when it has none)."""
    if not text.startswith("ANS @"):
        return 0, 0
    return 5, text.index(" ", 5)


def decision_weights(tokenizer, text: str, marker_weight: float, recipient_weight: float | None = None) -> list:
    """Per token of encode(text) + [end]: recipient_weight (default marker_weight) on tokens that start
    in the recipient name, marker_weight on the other tokens that start in the marker/fields and on the
    end token, 1 on the message's tokens."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    cut, (r0, r1) = field_chars(text), recipient_chars(text)
    recipient_weight = marker_weight if recipient_weight is None else recipient_weight
    return [recipient_weight if r0 <= start < r1 else marker_weight if start < cut else 1.0
            for start, _ in enc["offset_mapping"]] + [marker_weight]


def encode_example(session: dict, tokenizer, eos_id: int, weights_by_kind: dict, marker_weight: float,
                   max_len: int, recipient_weight: float | None = None, processor=None) -> dict | None:
    """{"input_ids", "weights", "media"} (weights[j]: the weight of predicting input_ids[j + 1]; media: the
    PlacedMedia within input_ids), the session cut to the whole intervals that fit in max_len; None when not one
    does. processor: the thinker's MediaProcessor for sessions with audio / video (livemoe.train.live.omni)."""
    enc = encode_session(session, tokenizer, eos_id, recorded=True, processor=processor)
    spans = [(s, e, k) for (s, e), k in zip(enc.decision_spans, enc.kinds) if e <= max_len]
    if not spans:
        return None
    ids = enc.input_ids[:spans[-1][1]]
    weights = [0.0] * (len(ids) - 1)
    for (s, e, kind), iv in zip(spans, session["intervals"]):
        w = decision_weights(tokenizer, decision_text(iv, recorded=True), marker_weight, recipient_weight)
        assert len(w) == e - s, (len(w), e - s)  # encode_session encodes the same text the same way
        for j, x in enumerate(w):
            weights[s + j - 1] = x * weights_by_kind[kind]
    return {"input_ids": ids, "weights": weights, "media": [m for m in enc.media if m.end <= len(ids)]}


def train_msft(model, tokenizer, sessions: list, opts: MSFTOptions, log=print, on_step=None) -> dict:
    """Trains model in place. on_step(step, metrics) is called after each optimizer step."""
    eos = tokenizer.eos_token_id
    kinds = [recorded_decision(iv)["kind"] for s in sessions for iv in s["intervals"]]
    weights_by_kind = class_weights(kinds, opts.balance)
    processor = omni.media_processor(model)
    examples = [e for s in sessions
                if (e := encode_example(s, tokenizer, eos, weights_by_kind, opts.marker_weight, opts.max_len,
                                        opts.recipient_weight, processor))]
    if not examples:
        raise ValueError(f"no session keeps an interval within max_len {opts.max_len}")
    plain = opts.marker_weight == opts.recipient_weight == 1.0 and opts.balance == 0.0
    name = "plain multi-turn SFT" if plain else "MA-MSFT"
    log(f"{name}: {len(examples)} sessions, {len(kinds)} intervals "
        f"({', '.join(f'{k} {kinds.count(k)}' for k in KINDS)}), class weights "
        f"{ {k: round(v, 3) for k, v in weights_by_kind.items()} }, marker weight {opts.marker_weight}, "
        f"recipient weight {opts.recipient_weight}")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    params = omni.trainable_parameters(model, opts.train_projector)
    optimizer = torch.optim.AdamW(params, lr=opts.lr)
    scheduler = make_scheduler(optimizer, opts.warmup_steps, opts.steps)
    guard = NonFiniteGuard(opts.max_nonfinite_steps)
    rng = torch.Generator().manual_seed(opts.seed)
    model.train()
    history = []
    for step in range(opts.steps):
        t0 = time.perf_counter()
        idx = torch.randint(len(examples), (opts.batch_size,), generator=rng).tolist()
        batch = collate([examples[i] for i in idx], pad, device)
        media = [examples[i]["media"] for i in idx]
        normalizer = batch["weights"][batch["targets"] != -100].sum()
        total, loss, aux = sft_step_loss(model, batch, normalizer, opts.lambda_aux, 1, contextlib.nullcontext(),
                                         forward=lambda b: omni.forward_hidden(model, b["input_ids"],
                                                                               b["attention_mask"], media))
        total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, opts.max_grad_norm)
        guard.step(optimizer, float(loss), grad_norm, f"MA-MSFT step {step + 1}")
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        row = {"step": step + 1, "loss": float(loss), "aux_loss": float(aux), "grad_norm": float(grad_norm),
               "time_s": time.perf_counter() - t0}
        history.append(row)
        if on_step is not None:
            on_step(step + 1, row)
    model.eval()
    return {"steps": opts.steps, "loss": history[-1]["loss"] if history else math.nan, "history": history,
            "class_weights": weights_by_kind}
