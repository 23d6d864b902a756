"""Builds the embedded default's base student: `python scripts/pretrain_student.py --output_dir livemoe/train/assets/student`
(from a checkout's root; a script, not part of the package: the trainers read what it made, the committed student).

1. a byte-level BPE tokenizer trained on the synthetic world's text, with a Qwen3-style chat template;
2. a tiny Qwen3-MoE (transformers' own implementation, so the checkpoint is the hub's layout);
3. pre-training on lookup conversations of the world (livemoe.train.synthetic.corpus): the product list, then
   several attribute questions, each answered with the bare fact. The loss is on the answers only: a
   random-init model needs thousands of steps before in-context lookup appears (issue 9 measured
   ~3,500 steps of batch 32), and masking the unpredictable product lists spends every step on it.
Writes the checkpoint (config.json, model.safetensors, tokenizer) and pretrain_report.json with the
figures reached (lookup exact-match on held-out rooms, loss, steps, minutes).

`--init_from DIR` continues from an earlier checkpoint of this command (its model and tokenizer) with a
fresh warm-up and schedule; the report keeps the earlier run's report under "init_report", so the
chain of commands that made a checkpoint stays on record. The learning rate decays (cosine, to a tenth)
over whichever budget ends first, --steps or --max_minutes, so a run stopped by the clock still ends
at the low learning rate that the last points of a run gain most from.

Recipe options: --curriculum_steps grows the product lists from 2 to the world's range (shorter lists,
shorter sequences early); --hidden_size/--layers/--heads/--kv_heads/--head_dim change the model's shape
(a new model only; --widen_heads / --widen_hidden grow an --init_from checkpoint's attention or residual
stream, computing what it computed); --recall_steps / --recall_fraction train a warm-up and then a share of the steps on
recall drills (livemoe.train.synthetic.corpus.recall_sequence: a compact product list, then --recall_queries lookups
in the world's own question and answer format). The report's final_lookup_probe says which hop of a
lookup fails: asked by name or by link, the whole answer exact and its link, name and value spans each
right (teacher-forced).
"""
import argparse
import json
import math
import os
import random
import sys
import time

# run by path (`python scripts/pretrain_student.py`), the package is the checkout's, beside this folder
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from livemoe.train.synthetic.corpus import (QUESTIONS_PER_CONVERSATION, RECALL_PRODUCTS, encode_conversation,
                                            lookup_conversation, recall_sequence, tokenizer_corpus)
from livemoe.train.synthetic.tokenizer import train_tokenizer
from livemoe.train.synthetic.world import WorldConfig, fact, make_rooms, products_of

MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=64, norm_topk_prob=True, max_position_embeddings=1024,
             rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=0.01)


def init_student(tok, seed: int = 0, **overrides):
    """A random-init tiny Qwen3-MoE (transformers) sized for `tok`; overrides change MODEL's fields."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **{**MODEL, **overrides})
    return AutoModelForCausalLM.from_config(cfg)


def batch(rooms, rng, tok, turns):
    return pad_batch([encode_conversation(lookup_conversation(r, rng, turns), tok) for r in rooms], tok)


def recall_batch(rooms, rng, tok, queries):
    return pad_batch([encode_conversation(recall_sequence(r, rng, queries), tok) for r in rooms], tok)


def is_recall_step(step: int, args) -> bool:
    """Whether 1-based `step` trains on recall drills (livemoe.train.synthetic.corpus.recall_sequence) instead of
    lookup conversations: every step of the --recall_steps warm-up, then a --recall_fraction of the steps,
    spread evenly (a whole batch of one kind: the drills are shorter, and mixing kinds would pad them)."""
    if step <= args.recall_steps:
        return True
    k = step - args.recall_steps
    return math.floor(k * args.recall_fraction) > math.floor((k - 1) * args.recall_fraction)


def pad_batch(seqs, tok):
    n = max(len(s[0]) for s in seqs)
    ids = torch.full((len(seqs), n), tok.pad_token_id)
    mask = torch.zeros((len(seqs), n))
    for i, (s, m) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, mask


def answer_loss(model, ids, mask, aux_coef=0.0):
    out = model(input_ids=ids, output_router_logits=aux_coef > 0)
    logits = out.logits[:, :-1].float()
    target, w = ids[:, 1:], mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    loss = (nll * w).sum() / w.sum()
    correct = ((logits.argmax(-1) == target) | (w == 0)).all(dim=1).float().mean()  # whole answers right
    aux = out.aux_loss if aux_coef > 0 and out.aux_loss is not None else torch.zeros(())
    return loss, aux, correct


@torch.no_grad()
def lookup_accuracy(model, rooms, tok, seed=0):
    """Fraction of held-out single-question conversations whose whole answer is predicted exactly."""
    model.eval()
    ids, mask = batch(rooms, random.Random(seed), tok, turns=1)
    _, _, acc = answer_loss(model, ids, mask)
    model.train()
    return acc.item()


# the probe's question forms: asked by the product's name (the student must find the link that precedes the
# name in the list) or by its link (the name and the attribute follow the link); livemoe.train.synthetic.world's
# attribute_question draws from these three
PROBE_FORMS = {"name": "what is the {attr} of the {name}?", "name2": "how about the {attr} of the {name}?",
               "link": "what is the {attr} of link {link}?"}


def answer_spans(p, attr, tok) -> dict:
    """Token spans of the link number, the name and the value in the tokens of fact(p, attr); refuses a
    tokenizer that merges across the parts (the spans would not be where the parts are)."""
    parts = [("", "link"), ("link", f" {p.link}"), ("name", f" {p.name}"), ("", f": {attr} is"),
             ("value", f" {p.attributes[attr]}"), ("", ".")]
    ids, spans = [], {}
    for label, text in parts:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        if label:
            spans[label] = (len(ids), len(ids) + len(piece))
        ids += piece
    if ids != tok(fact(p, attr), add_special_tokens=False)["input_ids"]:
        raise ValueError(f"the tokenizer merges across the parts of {fact(p, attr)!r}; no spans for the probe")
    return spans


@torch.no_grad()
def lookup_probe(model, rooms, tok, seed=0) -> dict:
    """Held-out single-question lookup by question form and by attribute, teacher-forced: the whole answer
    exact, and each of its link number, name and value right. Every room is asked once in each form
    about one fact."""
    from livemoe.train.data import build_messages

    rng = random.Random(seed)
    cases = []  # (form, attribute, ids, mask, {part: (start, end) in ids})
    for room in rooms:
        p = rng.choice(products_of(room))
        attr = rng.choice(sorted(p.attributes))
        system = build_messages({**room, "history": [], "question": "?"})[:1]
        for form, q in PROBE_FORMS.items():
            msgs = system + [{"role": "user", "content": q.format(attr=attr, name=p.name, link=p.link)},
                             {"role": "assistant", "content": fact(p, attr)}]
            ids, mask = encode_conversation(msgs, tok)
            at = mask.index(1)  # the answer's first token
            spans = {k: (at + a, at + b) for k, (a, b) in answer_spans(p, attr, tok).items()}
            cases.append((form, attr, ids, mask, spans))
    model.eval()
    counts = {}  # key -> [n, exact, link, name, value]
    for i in range(0, len(cases), 64):
        chunk = cases[i:i + 64]
        ids, mask = pad_batch([(c[2], c[3]) for c in chunk], tok)
        pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
        right = torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), pred == ids[:, 1:]], dim=1)  # at ids
        exact = (right | (mask == 0)).all(dim=1)
        for row, (form, attr, _, _, spans) in enumerate(chunk):
            parts = [int(right[row, a:b].all()) for a, b in (spans["link"], spans["name"], spans["value"])]
            for key in (f"form={form}", f"attr={attr}", "all"):
                o = counts.setdefault(key, [0] * 5)
                for j, v in enumerate([1, int(exact[row]), *parts]):
                    o[j] += v
    model.train()
    return {k: {"n": c[0], **{name: round(v / c[0], 3) for name, v in zip(("exact", "link", "name", "value"), c[1:])}}
            for k, c in sorted(counts.items())}


def lr_factor(step: int, minutes: float, args) -> float:
    """Linear warm-up, then cosine from 1 to 0.1 over whichever of --steps and --max_minutes ends first."""
    progress = min(1.0, max(step / args.steps, minutes / args.max_minutes))
    return min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def curriculum_products(step: int, args, world: WorldConfig) -> tuple:
    """Products per room at `step`: from 2 (short lists, short sequences: lookup is learned sooner) up to
    the world's own range, one product more every --curriculum_steps / (steps of the ramp), then the world's."""
    lo, hi = world.num_products
    if step >= args.curriculum_steps or hi <= 2:
        return lo, hi
    top = 2 + (hi - 2 + 1) * step // args.curriculum_steps
    return min(lo, top), min(hi, top)


ARCH_FLAGS = {"hidden_size": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
              "kv_heads": "num_key_value_heads", "head_dim": "head_dim"}


def _resized(model, **changes):
    """A random-init model (seed 0) of `model`'s config with `changes`: a widening's start, into which it
    copies the old weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(type(model.config)(**{**model.config.to_dict(), **changes}))


@torch.no_grad()
def widen_attention(model, heads: int):
    """The same model with `heads` query heads and as many KV heads (no grouped-query sharing), computing
    exactly what it computed: the old query heads keep their weights, each with a copy of the KV head it
    shared; the new heads start random with zero output projections, so they change nothing until trained.
    Issue 19: at 4 query heads over 2 KV heads the student never learned to find a product's link from its
    name (at chance over 29 CPU-minutes of drills); widened to 8 + 8 it did within ~16 more."""
    cfg = model.config
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if heads < max(h, kv):
        raise SystemExit(f"--widen_heads {heads}: the checkpoint has {h} query and {kv} KV heads; widening "
                         "cannot remove heads")
    wide = _resized(model, num_attention_heads=heads, num_key_value_heads=heads)
    old, new = model.state_dict(), wide.state_dict()
    for name, t in new.items():
        if name in old and old[name].shape == t.shape:
            t.copy_(old[name])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        new[p + "q_proj.weight"][: h * d] = old[p + "q_proj.weight"]
        for head in range(h):  # query head `head` read KV head head // (h // kv)
            src = slice(head // (h // kv) * d, (head // (h // kv) + 1) * d)
            new[p + "k_proj.weight"][head * d:(head + 1) * d] = old[p + "k_proj.weight"][src]
            new[p + "v_proj.weight"][head * d:(head + 1) * d] = old[p + "v_proj.weight"][src]
        new[p + "o_proj.weight"][:, : h * d] = old[p + "o_proj.weight"]
        new[p + "o_proj.weight"][:, h * d:] = 0
    assert not any("bias" in n for n in new if ".self_attn." in n and "norm" not in n), "attention biases: not handled"
    return wide


@torch.no_grad()
def widen_hidden(model, hidden: int):
    """The same model with a `hidden`-wide residual stream, computing what it computed (to ~1e-6): the old
    weights fill the leading rows/columns; what writes the residual stream (embeddings, o_proj, the experts'
    down_proj) writes zeros to the new dimensions, so they stay zero until trained; what reads it (q/k/v, the
    router, the experts' gate_up_proj, lm_head) gets random new columns that read those zeros; each hidden
    RMSNorm's weight is scaled by sqrt(old / new), since zero dimensions lower the root mean square by that
    factor. Issue 19: the 64-wide student binds a value to the wrong product of its list (a price read right
    35% of the time) and plateaued there; widened to 128, 35 CPU-minutes did not move it either (the
    student's README, round 4)."""
    cfg = model.config
    d = cfg.hidden_size
    if hidden <= d:
        raise SystemExit(f"--widen_hidden {hidden}: the checkpoint's hidden size is already {d}; widening "
                         "must grow it")
    # the eps scaled too, so the hidden norms' sqrt(mean(x^2) + eps) is exactly sqrt(d / hidden) times the old
    # (the trained embeddings' mean square is as low as 1.7e-4: eps matters); the per-head q/k norms share the
    # eps, a 1e-6 change there against mean squares near 1
    wide = _resized(model, hidden_size=hidden, rms_norm_eps=cfg.rms_norm_eps * d / hidden)
    old, new = model.state_dict(), wide.state_dict()
    assert old.keys() == new.keys(), "widening changed the parameter names"
    scale = math.sqrt(d / hidden)
    for name, t in new.items():
        o = old[name]
        if name.endswith(("layernorm.weight", "model.norm.weight")):
            t.copy_(torch.cat([o, o.new_full((hidden - d,), o.mean().item())]) * scale)
            continue
        assert t.dim() == o.dim() and all(a >= b for a, b in zip(t.shape, o.shape)), name
        t[tuple(slice(0, n) for n in o.shape)] = o
        if name.endswith("embed_tokens.weight"):
            t[:, d:] = 0
        elif name.endswith("o_proj.weight"):
            t[d:] = 0
        elif name.endswith("experts.down_proj"):  # (experts, hidden, intermediate)
            t[:, d:] = 0
        else:  # readers of the residual stream: the hidden size is their last dimension
            assert t.shape[:-1] == o.shape[:-1] and "bias" not in name, f"{name}: not a known reader or writer"
    return wide


def load_start(args):
    """(tokenizer, model, earlier report or None): a fresh tokenizer and random init, or --init_from's."""
    arch = {field: getattr(args, flag) for flag, field in ARCH_FLAGS.items() if getattr(args, flag) is not None}
    if not args.init_from:
        tok = train_tokenizer(tokenizer_corpus(), vocab_size=args.vocab_size)
        return tok, init_student(tok, seed=args.seed, **arch), None
    if arch:
        raise SystemExit(f"--init_from {args.init_from}: the model's shape is the checkpoint's; "
                         f"drop {', '.join('--' + f for f in ARCH_FLAGS if getattr(args, f) is not None)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(os.path.join(args.init_from, "config.json")):
        raise SystemExit(f"--init_from {args.init_from}: no checkpoint there (config.json is missing)")
    report_path = os.path.join(args.init_from, "pretrain_report.json")
    earlier = None
    if os.path.isfile(report_path):
        with open(report_path) as f:
            earlier = json.load(f)
    tok = AutoTokenizer.from_pretrained(args.init_from)
    model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
    if args.widen_heads:
        model = widen_attention(model, args.widen_heads)
    if args.widen_hidden:
        model = widen_hidden(model, args.widen_hidden)
    return tok, model, earlier


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output_dir", default="livemoe/train/assets/student")
    ap.add_argument("--init_from", default=None, help="continue from this checkpoint of this command "
                                                      "(default: a new tokenizer and a random init)")
    ap.add_argument("--steps", type=int, default=3600)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=QUESTIONS_PER_CONVERSATION, help="questions per pre-training conversation")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--vocab_size", type=int, default=1024)
    ap.add_argument("--max_minutes", type=float, default=40.0, help="stop early (and save) after this long")
    ap.add_argument("--eval_every", type=int, default=250)
    ap.add_argument("--heldout_rooms", type=int, default=256, help="held-out rooms of the lookup exact-match")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--curriculum_steps", type=int, default=0,
                    help="ramp products per room from 2 up to the world's range over this many steps (0: off)")
    ap.add_argument("--recall_steps", type=int, default=0,
                    help="warm-up: the first this many steps train on recall drills only (0: none)")
    ap.add_argument("--recall_fraction", type=float, default=0.0,
                    help="after the warm-up, this fraction of the steps (0-1) trains on recall drills: a compact "
                         "product list (one attribute each, 2 to 6 products) then --recall_queries questions")
    ap.add_argument("--recall_queries", type=int, default=None,
                    help="questions per recall drill (default 8; needs --recall_steps or --recall_fraction)")
    ap.add_argument("--widen_heads", type=int, default=None,
                    help="with --init_from: first widen the attention to this many query heads and as many KV "
                         "heads, computing exactly what the checkpoint computed (the new heads start silent)")
    ap.add_argument("--widen_hidden", type=int, default=None,
                    help="with --init_from: first widen the residual stream (hidden size) to this, computing what "
                         "the checkpoint computed (the new dimensions start at zero)")
    for flag, field in ARCH_FLAGS.items():
        ap.add_argument(f"--{flag}", type=int, default=None, help=f"model {field} (default {MODEL[field]})")
    # one thread: on a shared 2-core machine two threads per process oversubscribe and run ~5x slower
    ap.add_argument("--threads", type=int, default=1)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    for name in ("steps", "batch_size", "turns", "warmup", "eval_every", "heldout_rooms", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ARCH_FLAGS:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.curriculum_steps < 0:
        ap.error(f"--curriculum_steps must be >= 0, got {args.curriculum_steps}")
    if args.recall_steps < 0:
        ap.error(f"--recall_steps must be >= 0, got {args.recall_steps}")
    if not 0 <= args.recall_fraction <= 1:
        ap.error(f"--recall_fraction must be in [0, 1], got {args.recall_fraction}")
    if args.recall_queries is not None:
        if args.recall_steps == 0 and args.recall_fraction == 0:
            ap.error("--recall_queries needs recall drills: give --recall_steps or --recall_fraction")
        if args.recall_queries < 1:
            ap.error(f"--recall_queries must be >= 1, got {args.recall_queries}")
    else:
        args.recall_queries = 8
    if args.widen_heads is not None and (args.init_from is None or args.widen_heads < 1):
        ap.error("--widen_heads needs --init_from (a random init takes --heads and --kv_heads) and must be >= 1")
    if args.widen_hidden is not None and (args.init_from is None or args.widen_hidden < 1):
        ap.error("--widen_hidden needs --init_from (a random init takes --hidden_size) and must be >= 1")
    if args.lr <= 0 or args.max_minutes <= 0:
        ap.error("--lr and --max_minutes must be > 0")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0, cpu0 = time.time(), time.process_time()
    tok, model, earlier = load_start(args)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer {len(tok)} tokens; model {n_params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng = random.Random(args.seed)
    wcfg = WorldConfig()
    held_out = make_rooms(args.heldout_rooms, seed=10_000 + args.seed, cfg=wcfg, prefix="heldout")
    recall_cfg = WorldConfig(num_products=RECALL_PRODUCTS)
    history, step, loss_ema, recall_done = [], 0, None, 0
    if earlier is not None:  # where the earlier run left off, on this run's held-out rooms
        history.append({"step": 0, "heldout_lookup_exact": round(lookup_accuracy(model, held_out, tok), 3),
                        "minutes": 0.0})
        print(json.dumps(history[-1]), flush=True)
    model.train()
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(step - 1, (time.time() - t0) / 60, args)
        if is_recall_step(step, args):
            rooms = make_rooms(args.batch_size, seed=rng.randrange(1 << 30), cfg=recall_cfg)
            ids, mask = recall_batch(rooms, rng, tok, args.recall_queries)
            recall_done += 1
        else:
            step_cfg = WorldConfig(num_products=curriculum_products(step - 1, args, wcfg))
            rooms = make_rooms(args.batch_size, seed=rng.randrange(1 << 30), cfg=step_cfg)
            ids, mask = batch(rooms, rng, tok, args.turns)
        loss, aux, acc = answer_loss(model, ids, mask, aux_coef=cfg.router_aux_loss_coef)
        (loss + cfg.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), opt.zero_grad(set_to_none=True)
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        minutes = (time.time() - t0) / 60
        if step % args.eval_every == 0 or step == args.steps or minutes > args.max_minutes:
            acc_h = lookup_accuracy(model, held_out, tok)
            history.append({"step": step, "loss": round(loss_ema, 4), "train_exact": round(acc.item(), 3),
                            "heldout_lookup_exact": round(acc_h, 3), "minutes": round(minutes, 2),
                            "cpu_minutes": round((time.process_time() - cpu0) / 60, 2), "recall_steps": recall_done,
                            "lr": round(opt.param_groups[0]["lr"], 6)})
            print(json.dumps(history[-1]), flush=True)
            save(model, tok, args, argv, n_params, step, t0, history, earlier)  # usable at any time, even if stopped
        if minutes > args.max_minutes:
            break
    probe = lookup_probe(model, held_out, tok)
    save(model, tok, args, argv, n_params, step, t0, history, earlier, probe)
    print(json.dumps(probe))
    print(f"saved {args.output_dir}: held-out lookup exact {history[-1]['heldout_lookup_exact'] if history else None}")


def save(model, tok, args, argv, n_params, step, t0, history, earlier=None, probe=None):
    os.makedirs(args.output_dir, exist_ok=True)
    model.save_pretrained(args.output_dir)
    tok.save_pretrained(args.output_dir)
    report = {"command": "python scripts/pretrain_student.py " + " ".join(argv or []), "args": vars(args),
              "parameters": n_params, "steps": step, "minutes": round((time.time() - t0) / 60, 2),
              "final_heldout_lookup_exact": history[-1]["heldout_lookup_exact"] if history else None,
              "history": history}
    if probe is not None:
        report["final_lookup_probe"] = probe
    if earlier is not None:
        report["init_report"] = earlier
    with open(os.path.join(args.output_dir, "pretrain_report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
