"""The RFT run (livemoe.train.rft): the teacher stage (sample, judge, select), the SFT loop on the kept examples
(with the optional rehearsal of the pre-training lookups), and the before/after evaluation."""
import contextlib
import json
import math
import os
import random
import time

import torch

from livemoe.train import distributed
from livemoe.train.checkpoint import load_checkpoint, model_dir
from livemoe.train.config import format_config, save_config
from livemoe.train.data import load_inputs, load_jsonl, write_jsonl
from livemoe.train.judges import make_judge
from livemoe.train.nonfinite import NonFiniteGuard
from livemoe.train.packing import token_balanced_groups
from livemoe.train.rft.config import RFTConfig
from livemoe.train.selection import require_nonempty, select
from livemoe.train.sft import (collate, encode_example, epoch_batches, heldout_loss, make_scheduler, marker_token_ids,
                               sft_step_loss)
from livemoe.train.synthetic.world import WorldConfig


def log(msg: str) -> None:
    print(f"[rft] {msg}", flush=True)


def _bar(total, desc, enabled, unit="it"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True)


def teacher_stage(cfg: RFTConfig, records: list, judge, prefix: str = "") -> list:
    """Sample, judge, select; writes candidates.jsonl, selected.jsonl, selection.json (each name after
    `prefix`: heldout_ for the --eval_every set). -> kept examples."""
    from livemoe.train.teachers import make_teacher

    teacher = make_teacher(cfg)
    t0 = time.time()
    candidates = []
    bar = _bar(len(records), "teacher", cfg.progress, "input")
    chunk = 64
    for i in range(0, len(records), chunk):
        candidates += teacher.sample(records[i:i + chunk], k=cfg.k, temperature=cfg.temperature)
        bar.update(min(chunk, len(records) - i))
    bar.close()
    verdicts = []
    bar = _bar(len(records), "judge", cfg.progress, "input")
    for rec, cands in zip(records, candidates):
        verdicts.append(judge.judge_batch([rec] * len(cands), cands))
        bar.update(1)
    bar.close()
    kept, stats = select(records, candidates, verdicts, cfg.selection, cfg.seed)
    write_jsonl(os.path.join(cfg.output_dir, prefix + "candidates.jsonl"), [
        {"id": r["id"], "candidates": [{"completion": c, "correct": v.correct, "helpful": v.helpful,
                                        "reason": v.reason, "unparseable": v.unparseable} for c, v in zip(cs, vs)]}
        for r, cs, vs in zip(records, candidates, verdicts)])
    write_jsonl(os.path.join(cfg.output_dir, prefix + "selected.jsonl"), kept)
    with open(os.path.join(cfg.output_dir, prefix + "selection.json"), "w") as f:
        json.dump(stats.as_dict(), f, indent=1)
    log(f"teacher + judge{' (held-out)' if prefix else ''}: {stats.inputs} inputs x {cfg.k} = {stats.candidates} candidates in "
        f"{time.time() - t0:.1f}s; correct {stats.correct}, helpful {stats.helpful}, both {stats.both}; "
        f"kept {stats.kept}, dropped {stats.dropped}, unparseable verdicts {stats.unparseable}")
    require_nonempty(kept, stats)
    return kept


# ------------------------------------------------------------------------------------------ SFT data
# rehearsed answers before this one are not trained: a room's own question follows at most max_history answers
REHEARSAL_SKIP = WorldConfig().max_history + 1


# ------------------------------------------------------------------------------------------ the run
def resolve_device(cfg) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(cfg.device)


def encode_examples(cfg: RFTConfig, tokenizer, kept: list, what: str) -> list:
    """The SFT examples of `kept` (those with a completion token within --max_len)."""
    marker_ids = set(marker_token_ids(tokenizer, cfg.markers)) if cfg.marker_weight != 1.0 else set()
    examples = [e for e in (encode_example(rec, tokenizer, cfg.max_len, marker_ids, cfg.marker_weight)
                            for rec in kept) if e is not None]
    if len(examples) < len(kept):
        log(f"{len(kept) - len(examples)} selected {what} example(s) have no completion token within "
            f"--max_len {cfg.max_len}: left out")
    if not examples:
        raise ValueError(f"no {what} example keeps a completion token within --max_len {cfg.max_len}")
    return examples


def rehearsal_examples(cfg: RFTConfig, tokenizer, rooms: list, n: int) -> list:
    """n pre-training lookup conversations of `rooms` (livemoe.train.synthetic.corpus: the bare-answer lookups the base
    student learned) as SFT examples: what RFT would otherwise overwrite (issue 19). The loss is on the answers
    after the first REHEARSAL_SKIP only: a room's question comes after at most that many answered ones, so
    there the only target is the teacher's form (with the bare answers rehearsed at the same turns, the
    student answered three quarters of the attribute questions bare: no thought, no supplement, unhelpful)."""
    from livemoe.train.synthetic.corpus import QUESTIONS_PER_CONVERSATION, encode_conversation, lookup_conversation

    rng = random.Random(f"rehearsal/{cfg.seed}")
    out = []
    for i in range(n):
        msgs = lookup_conversation(rooms[i % len(rooms)], rng, QUESTIONS_PER_CONVERSATION)
        # encoded per message, so the untrained head (the list and the first answers) and the rest concatenate
        head = 1 + 2 * REHEARSAL_SKIP
        skipped, _ = encode_conversation(msgs[:head], tokenizer)
        rest, rest_mask = encode_conversation(msgs[head:], tokenizer)
        ids, mask = (skipped + rest)[:cfg.max_len], ([0] * len(skipped) + rest_mask)[:cfg.max_len]
        if any(mask[1:]):
            out.append({"input_ids": ids, "weights": [float(m) for m in mask[1:]]})
    return out


def train(cfg: RFTConfig, model, tokenizer, kept: list, device, resume_from=None, dist=None, eval_kept=(),
          rehearsal=()) -> dict:
    """The SFT loop; with cfg.eval_every, logs eval_loss on `eval_kept`; `rehearsal`: encoded examples shuffled
    in with the selected ones (rehearsal_examples). Returns {"steps", "loss", "examples", "tokens"}. `dist`
    (livemoe.train.distributed): every rank builds the same global step and computes its share (and the whole held-out
    loss, every rank alike); None in one process."""
    dist = dist or distributed.single_process()
    examples = encode_examples(cfg, tokenizer, kept, "training") + list(rehearsal)
    eval_examples = encode_examples(cfg, tokenizer, eval_kept, "held-out") if cfg.eval_every else []
    lengths = [len(e["input_ids"]) for e in examples]
    per_epoch = len(epoch_batches(lengths, cfg.batch_size, cfg.batching, 0))
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))
    dist.check_batch_sizes(cfg.batch_size, len(examples))
    if dist.mesh.distributed and cfg.max_tokens_per_micro_batch:
        # ranks would pack into different numbers of micro-batches, and every forward is a collective under FSDP/EP
        raise ValueError("--max_tokens_per_micro_batch does not run under torchrun for RFT yet (the ranks' micro-batch "
                         "counts would differ): leave it out, or run one process")
    targets = sum(sum(w > 0 for w in e["weights"]) for e in examples)
    log(f"SFT: {len(examples)} examples ({len(rehearsal)} of them rehearsal, {sum(lengths)} tokens, {targets}"
        f" target tokens), {per_epoch} micro-batches per epoch, {total_steps} optimizer steps")

    if cfg.gradient_checkpointing:
        model.gradient_checkpointing = True
    model.train()
    use_bf16 = uses_bf16(cfg, device)
    model = dist.parallelize(model, use_bf16)  # (a no-op for a model load_sharded has parallelized already)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, total_steps)
    start_step, micro_done = 0, 0
    guard = NonFiniteGuard(cfg.max_nonfinite_steps)
    if resume_from:
        state = load_checkpoint(resume_from, optimizer, scheduler, model=model, comm=dist)
        start_step, micro_done = state["step"], state["micro_batches_done"]
        guard.skipped = state.get("nonfinite_steps", 0)
        log(f"resumed from {resume_from}: step {start_step}, {micro_done} micro-batches done")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    metrics = distributed.metrics_logger(dist, cfg.output_dir, cfg.tensorboard,
                                         resume_step=start_step if resume_from else None)
    ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
    epoch_cache = {}

    def micro_batch(m):
        epoch, index = divmod(m, per_epoch)
        if epoch not in epoch_cache:
            epoch_cache.clear()
            epoch_cache[epoch] = epoch_batches(lengths, cfg.batch_size, cfg.batching, cfg.seed * 1000 + epoch)
        return [examples[i] for i in epoch_cache[epoch][index]]

    if eval_examples and start_step == 0:
        metrics.log(0, eval_loss=heldout_loss(model, eval_examples, tokenizer.pad_token_id, cfg.batch_size, device,
                                              autocast))
    bar = _bar(total_steps, "sft", cfg.progress, "step")
    bar.update(start_step)
    last_loss = None
    for step in range(start_step, total_steps):
        t0 = time.time()
        group = [micro_batch(micro_done + j) for j in range(cfg.grad_accum)]
        micro_done += cfg.grad_accum
        batches = [collate(g, tokenizer.pad_token_id, device) for g in group]
        normalizer = sum(b["weights"][b["targets"] != -100].sum() for b in batches)
        if not normalizer > 0:
            raise ValueError(f"step {step + 1}: the batch has no target token (every completion token is masked)")
        if dist.mesh.distributed:  # the normalizer above is the global batch's; each rank computes its share
            batches = [collate(dist.local_share(g), tokenizer.pad_token_id, device) for g in group]
        elif cfg.max_tokens_per_micro_batch:  # the step's examples regrouped by tokens: the normalizer is the step's
            step_examples = [e for g in group for e in g]
            packs = token_balanced_groups([len(e["input_ids"]) for e in step_examples], cfg.max_tokens_per_micro_batch)
            batches = [collate([step_examples[i] for i in p], tokenizer.pad_token_id, device) for p in packs]
        figures = torch.zeros(3, dtype=torch.float64, device=device)  # loss, aux loss, tokens: summed on the device
        for b in batches:
            total, loss, aux = sft_step_loss(model, b, normalizer, cfg.lambda_aux, len(batches), autocast,
                                             dist.group)
            total.backward()
            figures += torch.stack([loss, aux / len(batches), b["attention_mask"].sum()]).double()
        grad_norm = dist.clip_grad_norm_(model.parameters(), cfg.max_grad_norm if cfg.max_grad_norm > 0
                                         else float("inf"))
        # the global step's figures (every rank's guard then decides alike), on the host once per step
        loss_sum, aux_sum, tokens = dist.sum(figures).tolist()
        tokens = int(tokens)
        lr = scheduler.get_last_lr()[0]
        guard.step(optimizer, loss_sum, grad_norm, f"step {step + 1}")
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.time() - t0
        last_loss = loss_sum
        extra = {}
        if eval_examples and ((step + 1) % cfg.eval_every == 0 or step + 1 == total_steps):
            extra["eval_loss"] = heldout_loss(model, eval_examples, tokenizer.pad_token_id, cfg.batch_size, device,
                                              autocast)
        if (step + 1) % cfg.log_every == 0 or step + 1 == total_steps or extra:
            metrics.log(step + 1, loss=loss_sum, aux_loss=aux_sum, lr=lr, grad_norm=float(grad_norm),
                        tokens_per_s=tokens / dt, tokens=tokens, nonfinite_steps=guard.skipped, **extra)
        bar.set_postfix(loss=f"{loss_sum:.3f}", aux=f"{aux_sum:.3f}", tok_s=f"{tokens / dt:.0f}")
        bar.update(1)
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == total_steps:
            dist.save_checkpoint(ckpt_root, step + 1, model, optimizer, scheduler,
                                 {"micro_batches_done": micro_done, "total_steps": total_steps,
                                  "nonfinite_steps": guard.skipped}, cfg.keep_last, tokenizer=tokenizer,
                                 save_model=_save_model)
    bar.close()
    metrics.close(plot=cfg.plot)
    model.eval()
    return {"steps": total_steps, "loss": last_loss, "examples": len(examples), "tokens": sum(lengths)}


def _save_model(model, path):
    from livemoe.engine import save_model

    save_model(model, path)


def uses_bf16(cfg: RFTConfig, device) -> bool:
    return cfg.bf16 == "true" or (cfg.bf16 == "auto" and device.type == "cuda")


def run(cfg: RFTConfig) -> dict:
    threads = torch.get_num_threads()
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (a test suite) keeps its own setting


def _run(cfg: RFTConfig) -> dict:
    from livemoe import engine
    from livemoe.train.evaluate import evaluate, summarize, write_eval

    dist = distributed.setup_trainer(cfg, cfg.output_dir)
    os.makedirs(cfg.output_dir, exist_ok=True)
    print("resolved config:\n" + format_config(cfg), flush=True)
    if dist.is_main:
        save_config(cfg, cfg.output_dir)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = dist.device(resolve_device(cfg))
    resume_from = dist.resolve_resume(cfg.resume, os.path.join(cfg.output_dir, "checkpoints"))
    train_inputs, held_out = load_inputs(cfg)
    judge = make_judge(cfg)

    selected_path = os.path.join(cfg.output_dir, "selected.jsonl")
    if resume_from and os.path.exists(selected_path):
        kept, _ = load_jsonl(selected_path)  # the data the interrupted run trained on
        log(f"resuming: reusing {len(kept)} selected examples from {selected_path}")
    else:
        kept = dist.from_main(lambda: teacher_stage(cfg, train_inputs, judge))
    eval_kept = []
    if cfg.eval_every:  # held-out answers of the same teacher and judge, so eval_loss measures the SFT target
        heldout_path = os.path.join(cfg.output_dir, "heldout_selected.jsonl")
        if resume_from and os.path.exists(heldout_path):
            eval_kept, _ = load_jsonl(heldout_path)
        else:
            eval_kept = dist.from_main(lambda: teacher_stage(cfg, held_out, judge, prefix="heldout_"))

    tokenizer = engine.load_tokenizer(cfg.model)
    if tokenizer is None:
        raise ValueError(f"--model {cfg.model}: the checkpoint has no tokenizer (tokenizer.json)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # a sharded checkpoint's weights load in train(), into the sharded model; under torchrun each rank reads only
    # its own shards of the checkpoint (built on the meta device)
    path = model_dir(resume_from) or cfg.model
    model = (dist.load_sharded(path, torch.float32, uses_bf16(cfg, device)) if dist.mesh.distributed
             else engine.load_model(path, dtype=torch.float32, device=device))

    rows = []
    eval_kw = dict(max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.eval_temperature, seed=cfg.seed,
                   progress=cfg.progress, samples=cfg.eval_samples)
    before_path = os.path.join(cfg.output_dir, "eval_before.json")
    if held_out and dist.is_main:  # rank 0 evaluates the whole model (its own copy under torchrun)
        if cfg.teacher == "scripted":  # the teacher's own row, as in the seed's Table 3 (no decode cost)
            from livemoe.train.teachers import make_teacher

            texts = [c[0] for c in make_teacher(cfg).sample(held_out, k=1)]
            lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]
            rows.append(summarize(held_out, texts, lengths, judge, "teacher (scripted)"))
        if resume_from and os.path.exists(before_path):
            with open(before_path) as f:
                rows.append(json.load(f))
        else:
            whole = resume_from or dist.mesh.distributed
            base = engine.load_model(cfg.model, dtype=torch.float32, device=device) if whole else model
            t0 = time.time()
            rows.append(evaluate(base, tokenizer, held_out, judge, label="student", **eval_kw))
            log(f"eval before: {time.time() - t0:.1f}s")
            with open(before_path, "w") as f:
                json.dump(rows[-1], f)

    dist.barrier()
    rehearsal = rehearsal_examples(cfg, tokenizer, train_inputs, round(cfg.rehearsal * len(kept)))
    result = train(cfg, model, tokenizer, kept, device, resume_from, dist, eval_kept, rehearsal)
    final_dir = os.path.join(cfg.output_dir, "final")
    dist.export(model, final_dir, tokenizer)  # parallelize() sharded `model` in place
    log(f"final model (HF safetensors layout): {final_dir}")
    if dist.mesh.distributed:  # rank 0 evaluates the exported model; the others are done
        dist.close()
        if not dist.is_main:
            return {**result, "rows": [], "final_dir": final_dir}
        model = engine.load_model(final_dir, dtype=torch.float32, device=device)

    if held_out:
        t0 = time.time()
        rows.append(evaluate(model, tokenizer, held_out, judge, label="student + RFT", **eval_kw))
        log(f"eval after: {time.time() - t0:.1f}s")
        table = write_eval(cfg.output_dir, rows)
        print("\n" + table + "\n", flush=True)
        log(f"table written to {os.path.join(cfg.output_dir, 'eval_table.md')}")
    return {**result, "rows": rows, "final_dir": final_dir}

