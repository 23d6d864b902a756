"""GRPOTrainer (livemoe.train.grpo): one method per phase of a step, as torchtitan's Trainer has: the rollout
phase (K rollouts per prompt from the decoder, rewards, group advantages), the update phase (μ optimizer passes
of the clipped policy loss), evaluation, checkpoints, and the loop. One class over ~450 lines: its phases
share the model, the reference, the rollouts and the optimizer, and splitting it would scatter that state."""
import contextlib
import dataclasses
import functools
import json
import math
import os
import time

import torch

from livemoe.engine.model import flops
from livemoe.engine.model.loader import load_model, load_tokenizer
from livemoe.engine.model.saver import save_model
from livemoe.kernels.batch_invariant import batch_invariant_mode, unavailable_reason
from livemoe.kernels.logprobs import fused_linear_logprobs
from livemoe.train import distributed
from livemoe.train.advantages import ZERO_STD, group_advantages, multi_turn_advantages, token_advantages
from livemoe.train.checkpoint import is_sharded, load_checkpoint, model_dir
from livemoe.train.config import ConfigError, save_config
from livemoe.train.data import build_prompt, split_thought
from livemoe.train.grpo.async_rollouts import AsyncRollouts
from livemoe.train.grpo.config import GRPOConfig
from livemoe.train.grpo.start import load_records, resolve_start
from livemoe.train.judges import make_judge
from livemoe.train.losses import policy_loss
from livemoe.train.mismatch import MismatchMeter, rollout_correction
from livemoe.train.nonfinite import NonFiniteGuard
from livemoe.train.packing import token_balanced_groups
from livemoe.train.precision import MasterWeights
from livemoe.train.rewards import CompositeReward
from livemoe.train.rollout import Rollouts, collate, reference_lengths, shuffled_order
from livemoe.train.shared_prefix import forward_shared, pack_prompts


def _turn_record(record: dict, turn: int, responses: list) -> dict:
    """The judged record of turn `turn`: its question and meta, the trajectory's earlier turns as history."""
    if turn == 0:
        return record
    f = record["followups"][turn - 1]
    f = {"question": f} if isinstance(f, str) else f
    qs = [record["question"]] + [(x if isinstance(x, str) else x["question"]) for x in record["followups"]]
    history = list(record.get("history", [])) + [
        {"question": q, "response": split_thought(r)[1]} for q, r in zip(qs[:turn], responses[:turn])]
    return {**record, "id": f"{record['id']}#{turn}", "question": f["question"], "history": history,
            "meta": f.get("meta", record.get("meta", {})), "reference": f.get("reference")}


PER_TOKEN = ("input_ids", "attention_mask", "routed_experts", "routed_mask")  # [N, T]; the others are [N, T - 1]


# ------------------------------------------------------------------------------------------ trainer
class GRPOTrainer:
    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if cfg.device == "auto" else cfg.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device")
        use_bf16 = cfg.bf16 == "true" or (cfg.bf16 == "auto" and self.device.type == "cuda")
        self.dtype = torch.bfloat16 if use_bf16 else torch.float32
        if getattr(cfg, "threads", 0):
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
        if distributed.world_size() > 1 and cfg.model == "auto":
            raise ConfigError("--model auto under torchrun: pass --model CHECKPOINT_DIR (the RFT default's student "
                              "is made by one process: run livemoe.train.rft first)")
        self.dist = distributed.setup_trainer(cfg, cfg.output_dir, "" if cfg.model == "auto" else cfg.model)
        self.device = self.dist.device(self.device)
        self.resume_from = self.dist.resolve_resume(cfg.resume, self.ckpt_root)
        state = {}
        if self.resume_from:
            with open(os.path.join(self.resume_from, "trainer_state.json")) as f:
                state = json.load(f)
        self.start_model = state.get("start_model") or resolve_start(cfg)
        model_path = model_dir(self.resume_from) or self.start_model  # a sharded checkpoint loads below
        # fp32 from the file: with bf16 the fp32 values stay as the optimizer's master weights (one device), or
        # FSDP2's sharded fp32 parameters (torchrun), which the rollout decoder reads as a gathered inference copy
        # under torchrun each rank reads only its own shards of the checkpoint (built on the meta device)
        self.model = (self.dist.load_sharded(model_path, torch.float32, self.dtype == torch.bfloat16)
                      if self.dist.mesh.distributed else load_model(model_path, dtype=torch.float32, device=self.device))
        self.model.gradient_checkpointing = cfg.gradient_checkpointing
        self.master = self.infer = None
        rollout_dtype = self.dtype if cfg.rollout_dtype == "auto" else getattr(torch, cfg.rollout_dtype)
        if not self.dist.mesh.distributed and self.dtype != torch.float32:
            self.master = MasterWeights(self.model, self.dtype)
        if cfg.exact_rollouts and (self.dist.mesh.distributed or (reason := unavailable_reason(self.device))):
            raise ConfigError("--exact_rollouts: " + ("one process only (the batch-invariant kernels have no sharded "
                                                      "version)" if self.dist.mesh.distributed else reason))
        self.train_records, self.eval_records = load_records(cfg)
        # rollout servers under torchrun with nothing for rank 0 to evaluate: the push streams from the shards (not
        # with --async_rollouts: the producer thread pushes the versions it loads, from a gathered copy)
        self.stream_push = bool(cfg.rollout_url and self.dist.mesh.distributed and not self.eval_records
                                and not cfg.async_rollouts)
        if (self.dist.mesh.distributed and not self.stream_push) or rollout_dtype != self.dtype:
            self.infer = self.dist.inference_copy(self.model, rollout_dtype)  # refreshed after each optimizer step
        self.tokenizer = load_tokenizer(model_path) or load_tokenizer(self.start_model)
        if self.tokenizer is None:
            raise ConfigError(f"{self.start_model}: the checkpoint has no tokenizer (the prompts are text)")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.ref_model = None
        if cfg.loss.beta > 0:  # the frozen starting checkpoint; not loaded at all when β = 0
            self.ref_model = self._load_reference()
        self.prompts = [build_prompt(r, self.tokenizer) for r in self.train_records]
        self.judge = make_judge(cfg)
        self.reward = CompositeReward(self.judge, cfg.reward)
        # dr_grpo's constant is the rollouts' length limit
        self.loss_cfg = dataclasses.replace(cfg.loss, max_completion_length=cfg.max_new_tokens)
        # the decoder's routed experts come back with every MoE rollout: the routing-disagreement metric and R3 read them
        routed = self.model.num_moe_layers > 0
        if cfg.routing_replay == "R3" and not routed:
            raise ConfigError("--routing_replay R3: the model is dense (no MoE layer has routing to replay)")
        if cfg.rollout_url:  # servers decode; the weights are pushed to them after each step
            from livemoe.train.remote_rollout import RemoteRollouts

            s = self._sampling()
            # under torchrun rank 0 pushes its gathered copy (one broadcast to every replica), after every rank's update
            self.rollouts = RemoteRollouts(cfg.rollout_url.split(","), self.tokenizer, self.infer or self.model,
                                           num_generations=cfg.num_generations, max_new_tokens=cfg.max_new_tokens,
                                           seed=cfg.seed, weight_sync=cfg.weight_sync, temperature=s["temperature"],
                                           top_p=s["top_p"], top_k=s["top_k"], return_routed_experts=routed,
                                           main=self.dist.is_main, barrier=self.dist.barrier,
                                           **(dict(gather=self._gathered, push_dtype=self.dtype)
                                              if self.stream_push else {}))
        else:
            self.rollouts = Rollouts(self.infer or self.model, self.tokenizer, num_generations=cfg.num_generations,
                                     max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, return_routed_experts=routed,
                                     batch_invariant=cfg.exact_rollouts, **self._sampling())
        n = len(self.train_records)
        self.total_steps = cfg.max_steps or math.ceil(cfg.epochs * n / cfg.batch_size)
        # what the optimizer updates and clipping reads: the fp32 masters under bf16
        self.trainable = self.master.parameters() if self.master else [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warm = cfg.warmup_steps * cfg.num_iterations
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / max(1, warm)))
        self.step = 0
        self.ref_lengths: dict = {}
        self.before = None
        self.guard = NonFiniteGuard(cfg.max_nonfinite_steps)
        if self.resume_from:
            if self.master and is_sharded(self.resume_from):
                raise ConfigError(f"{self.resume_from}: written under torchrun; resuming it as one process with bf16 "
                                  "weights is not supported (use --bf16 false, or torchrun)")
            state = load_checkpoint(self.resume_from, self.optimizer, self.scheduler, model=self.model, comm=self.dist)
            if self.infer is not None:
                self.dist.refresh_copy(self.model, self.infer)
            self.step, self.ref_lengths, self.before = state["step"], state["ref_lengths"], state.get("before")
            self.guard.skipped = state.get("nonfinite_steps", 0)
        self.metrics = distributed.metrics_logger(self.dist, cfg.output_dir, cfg.tensorboard,
                                                  resume_step=self.step if self.resume_from else None)

    def _gathered(self, model):
        """The sharded model's tensors gathered whole one at a time, in the compute dtype (every rank iterates)."""
        return ((name, t.to(self.dtype)) for name, t in self.dist.full_tensors(model))

    def _load_reference(self):
        """The frozen starting checkpoint in the compute dtype (no master copy: it never trains); under torchrun
        sharded like the policy."""
        if self.dist.mesh.distributed:
            return self.dist.load_sharded(self.start_model, self.dtype, self.dtype == torch.bfloat16).requires_grad_(False)
        return load_model(self.start_model, dtype=self.dtype, device=self.device).requires_grad_(False)

    # -- data ---------------------------------------------------------------------------------------
    def batch_indices(self, step: int) -> list:
        n, b = len(self.train_records), self.cfg.batch_size
        out = []
        for j in range(step * b, step * b + b):
            out.append(shuffled_order(n, self.cfg.seed, j // n)[j % n])
        return out

    def compute_reference_lengths(self) -> None:
        """L_ref of every prompt this run will use (every turn, multi-turn), from the starting
        checkpoint: the policy itself before the first update, else the frozen reference (loaded for
        the occasion when β = 0). Kept in the checkpoints, so a resumed run reuses them."""
        steps = range(self.step, self.total_steps)
        used = sorted({i for s in steps for i in self.batch_indices(s)})
        if self.cfg.dynamic_sampling:  # refill rounds may draw any record
            used = list(range(len(self.train_records)))
        key = (lambda r: f"{r['id']}#0") if self.cfg.multi_turn else (lambda r: r["id"])
        todo = [i for i in used if key(self.train_records[i]) not in self.ref_lengths]
        if not todo:
            return
        source = self.rollouts
        if self.step > 0:  # the policy has moved: decode with the starting checkpoint instead
            plain_ref = None if self.dist.mesh.distributed else self.ref_model  # a sharded one cannot decode
            ref = plain_ref or load_model(self.start_model, dtype=self.dtype, device=self.device)
            self.rollouts.release()
            source = Rollouts(ref, self.tokenizer, num_generations=self.cfg.num_generations,
                              max_new_tokens=self.cfg.max_new_tokens, seed=self.cfg.seed, **self._sampling())
        t0 = time.perf_counter()
        # each rank decodes its share (greedy, or sampled seeded by record id: any split gives the same lengths)
        mine = todo[self.dist.rank::self.dist.world_size]
        if self.cfg.multi_turn:  # one greedy trajectory: per-turn lengths
            found = {}
            trajs = self._multi_turn_rollouts(mine, step=-1, greedy=True, rollouts=source)
            for i, group in zip(mine, trajs):
                for t, (s, e) in enumerate(group[0].turn_spans):
                    found[f"{self.train_records[i]['id']}#{t}"] = max(1, e - s)
        else:
            found = reference_lengths(source, [self.train_records[i] for i in mine], [self.prompts[i] for i in mine],
                                      {}, self.cfg.ref_samples)
        for part in self.dist.all_gather_objects(found):
            self.ref_lengths.update(part)
        source.release()
        if self.cfg.progress:
            print(f"L_ref of {len(todo)} prompts in {time.perf_counter() - t0:.1f}s", flush=True)

    def _sampling(self) -> dict:
        cfg = self.cfg
        return dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                    kv_cache_bytes=cfg.rollout_kv_bytes, max_num_seqs=cfg.rollout_max_num_seqs,
                    speculative_config=cfg.rollout_speculative_config or None)

    def _multi_turn_rollouts(self, indices: list, step, greedy: bool = False, rollouts=None,
                             keys: list | None = None) -> list:
        firsts, nexts = [], []
        for i in indices:
            r = self.train_records[i]
            firsts.append(self.prompts[i])
            turns = []
            for f in r.get("followups", []):
                q = f if isinstance(f, str) else f["question"]
                text = "\n" + self.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                  add_generation_prompt=True)
                turns.append(text)
            nexts.append(turns)
        return (rollouts or self.rollouts).generate_multi_turn(firsts, nexts, step, greedy=greedy, keys=keys)

    # -- rollouts and rewards -----------------------------------------------------------------------
    def refill_indices(self, step: int, rnd: int) -> list:
        """The prompts of generation round rnd >= 1 of a step (--dynamic_sampling): a shuffle of the training
        records of its own, a pure function of (seed, step, round), so a resumed run refills alike."""
        n, b = len(self.train_records), self.cfg.batch_size
        order = shuffled_order(n, self.cfg.seed, f"refill/{step}/{rnd}")
        return [order[j % n] for j in range(b)]

    def sample_round(self, step: int, rnd: int, indices: list, rollouts=None, comm=None) -> list:
        """One generation round: K rollouts of each prompt of `indices` (the global batch; this rank decodes its
        share), judged; comm: whose gather (the producer thread's side channel; default the trainer's). -> per global
        group a dict: rewards (K floats; multi-turn K lists of turn rewards), values (reward component -> K values),
        shape (K (length, tokens, truncated)), comps (this rank's K Completions, None for another rank's group),
        prompt (the record's index)."""
        cfg, K = self.cfg, self.cfg.num_generations
        rollouts, comm = rollouts or self.rollouts, comm or self.dist
        places = comm.local_share(list(range(len(indices))), "batch of prompts")
        idx = [indices[p] for p in places]
        seed_step = step if rnd == 0 else f"{step}/{rnd}"  # round 0 draws what a run without refills draws
        with torch.no_grad():
            if cfg.multi_turn:
                groups = self._multi_turn_rollouts(idx, seed_step, keys=places, rollouts=rollouts)
            else:
                groups = rollouts.generate([self.prompts[i] for i in idx], seed_step, keys=places)
        comps = [c for g in groups for c in g]
        records = [self.train_records[i] for i in idx for _ in range(K)]
        results = []  # per completion: (reward or turn rewards, its components)
        if cfg.multi_turn:  # each turn judged as its own record, with the trajectory's earlier turns as history
            for rec, c in zip(records, comps):
                recs = [_turn_record(rec, t, c.turn_texts) for t in range(len(c.turn_spans))]
                lens = [e - s for s, e in c.turn_spans]
                refs = [self.ref_lengths[f"{rec['id']}#{t}"] for t in range(len(recs))]
                res = self.reward(recs, c.turn_texts, lens, refs)
                values: dict = {}
                _add_components(values, res)
                results.append(([x.reward for x in res], values))
        elif comps:
            refs = [self.ref_lengths[r["id"]] for r in records]
            res = self.reward(records, [c.text for c in comps], [c.length for c in comps], refs)
            results = [(x.reward, {k: [v] for k, v in x.components.items()}) for x in res]
        mine = []
        for j, i in enumerate(idx):
            part, cs = results[j * K:(j + 1) * K], comps[j * K:(j + 1) * K]
            values = {}
            for _, v in part:
                for k, xs in v.items():
                    values.setdefault(k, []).extend(xs)
            mine.append({"prompt": i, "rewards": [r for r, _ in part], "values": values,
                         "shape": [(c.length, len(c.token_ids), c.truncated) for c in cs]})
        # every rank's groups in global order: advantages (group or batch statistics) and metrics are the
        # one-process ones; this rank keeps its own completions
        out = [{**g, "comps": None} for part in comm.all_gather_objects(mine) for g in part]
        for p, g in zip(places, groups):
            out[p]["comps"] = g
        return out

    def sample_groups(self, step: int, rollouts=None, comm=None) -> dict:
        """The step's rollouts: one round of --batch_size prompts, or with --dynamic_sampling rounds of them until
        --batch_size groups with a reward spread are kept (at most --dynamic_sampling_rounds; the surplus of the
        last round is cut). -> {"sampled": every group rolled out, "kept": the groups to train on, "rounds",
        "time"}."""
        cfg = self.cfg
        t0 = time.perf_counter()
        sampled, kept, rounds = [], [], 0
        for rnd in range(cfg.dynamic_sampling_rounds if cfg.dynamic_sampling else 1):
            indices = self.batch_indices(step) if rnd == 0 else self.refill_indices(step, rnd)
            groups = self.sample_round(step, rnd, indices, rollouts, comm)
            sampled += groups
            rounds += 1
            kept += [g for g in groups if not cfg.dynamic_sampling or _reward_spread(g)]
            if len(kept) >= cfg.batch_size:
                break
        return {"sampled": sampled, "kept": kept[:cfg.batch_size], "rounds": rounds,
                "time": time.perf_counter() - t0}

    def rollout_phase(self, step: int) -> tuple:
        """The step's rollouts (sample_groups) -> (this rank's training batch or None, metrics)."""
        self.model.eval()
        out = self.sample_groups(step)
        self.rollouts.release()  # the update never shares memory with the KV cache
        return self.make_batch(out)

    def make_batch(self, out: dict) -> tuple:
        """Rewards -> advantages over the kept groups -> this rank's collated batch (None when it keeps nothing),
        and the step's rollout metrics (over every rollout sampled, so the reward curve is the policy's)."""
        cfg, K = self.cfg, self.cfg.num_generations
        sampled, kept = out["sampled"], out["kept"]
        mine = [j for j, g in enumerate(kept) if g["comps"] is not None]
        comps = [c for j in mine for c in kept[j]["comps"]]
        advantages, keep = [], []
        if kept and cfg.multi_turn:
            all_turns = [r for g in kept for r in g["rewards"]]
            adv_turns = multi_turn_advantages(all_turns, K, cfg.turn_weight, cfg.advantage_eps, cfg.scale_rewards)
            for j in mine:
                for c, a in zip(kept[j]["comps"], adv_turns[j * K:(j + 1) * K]):
                    advantages.append(token_advantages(c.turn_spans, a, len(c.token_ids))[0])
            _, keep_all, _ = group_advantages(torch.tensor([sum(t) / len(t) for t in all_turns]), K,
                                              cfg.scale_rewards, cfg.advantage_eps, cfg.drop_zero_variance)
        elif kept:
            adv_all, keep_all, _ = group_advantages(torch.tensor([r for g in kept for r in g["rewards"]]), K,
                                                    cfg.scale_rewards, cfg.advantage_eps, cfg.drop_zero_variance)
            advantages = [float(a) for j in mine for a in adv_all[j * K:(j + 1) * K]]
        if kept:
            keep = [bool(x) for j in mine for x in keep_all[j * K:(j + 1) * K]]
        all_rewards = [r for g in sampled for r in g["rewards"]]
        rewards = torch.tensor([sum(r) / len(r) for r in all_rewards] if cfg.multi_turn else all_rewards)
        shape = [t for g in sampled for t in g["shape"]]
        lengths = torch.tensor([float(n) for n, _, _ in shape])
        gen_tokens = sum(n for _, n, _ in shape)
        zero_variance = sum(not _reward_spread(g) for g in sampled)
        m = {"reward/mean": rewards.mean(), "reward/std": rewards.std()}
        for k in dict.fromkeys(k for g in sampled for k in g["values"]):
            t = torch.tensor([v for g in sampled for v in g["values"].get(k, [])], dtype=torch.float32)
            m[f"reward/{k}/mean"], m[f"reward/{k}/std"] = t.mean(), t.std() if t.numel() > 1 else 0.0
        t_rollout = out["time"]
        m.update({"tpr/mean": lengths.mean(), "tpr/min": lengths.min(), "tpr/max": lengths.max(),
                  "truncated_frac": sum(t for _, _, t in shape) / len(shape),
                  "zero_variance_groups": zero_variance,
                  "time/rollout_s": t_rollout, "rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
                  "decode_gflops_per_response": flops.decode_flops(self.model.config, float(lengths.mean())) / 1e9})
        if cfg.dynamic_sampling:
            m.update({"dynamic_sampling/rounds": out["rounds"], "dynamic_sampling/dropped_groups": zero_variance,
                      "dynamic_sampling/kept_groups": len(kept)})
        kept_rows = [i for i in range(len(comps)) if keep[i]]
        batch = None
        if kept_rows:  # under torchrun a rank may keep nothing while others do: update_phase runs on every rank
            batch = collate([comps[i] for i in kept_rows], [advantages[i] for i in kept_rows], self.pad_id,
                            cfg.mask_truncated)
        return batch, m

    # -- the update ---------------------------------------------------------------------------------
    def _logprobs(self, model, mb, entropy: bool = False):
        replay = mb.get("routed_experts") if self.cfg.routing_replay == "R3" else None  # the empty micro-batch: none
        with batch_invariant_mode(self.cfg.exact_rollouts):  # the decoder's kernels: its log-probs to the bit
            if mb.get("shared") is not None:  # one forward per prompt (livemoe/train/shared_prefix.py)
                hidden, router_logits = forward_shared(model, mb["shared"])
            else:
                hidden, router_logits = model.forward_hidden(mb["input_ids"], attention_mask=mb["attention_mask"],
                                                             return_router_logits=True, routed_experts=replay)
            out = fused_linear_logprobs(hidden[:, :-1], model.lm_head_weight, mb["targets"], self.rollouts.temperature,
                                        mask=mb["completion_mask"] > 0, return_entropy=entropy)
        return out, router_logits

    def _micro_batches(self, batch) -> list:
        """--micro_batch_size rows at a time, or with --max_tokens_per_micro_batch token-balanced groups of rows
        (livemoe/train/packing.py), each trimmed of its right padding."""
        n, size = batch["input_ids"].shape[0], self.cfg.micro_batch_size
        if self.cfg.max_tokens_per_micro_batch:
            groups = token_balanced_groups(batch["attention_mask"].sum(1).tolist(), self.cfg.max_tokens_per_micro_batch)
        else:
            assert size is not None  # GRPOConfig.validate: 32 unless the micro-batches are sized by tokens
            groups = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
        out = []
        for rows in groups:
            index = torch.tensor(rows)
            mb = {k: v[index].to(self.device) for k, v in batch.items()}
            width = int(mb["attention_mask"].sum(1).max())  # trim the right padding of this micro-batch
            mb = {k: v if v.dim() == 1 else v[:, :width] if k in PER_TOKEN else v[:, :width - 1] for k, v in mb.items()}
            mb["rollout_logprobs"] = mb["old_logprobs"]  # the decoder's; old_logprobs may become the trainer's
            # unshared: R3 replays per row, and exact mode's attention takes the decoder's right-padded rows
            if self.cfg.prompt_sharing and self.cfg.routing_replay == "none" and not self.cfg.exact_rollouts:
                mb["shared"] = pack_prompts(mb["input_ids"], mb["attention_mask"], mb["prompt_lens"], self.pad_id)
            out.append(mb)
        return out

    def _empty_micro_batch(self) -> dict:
        """A one-row micro-batch that adds nothing (no completion token, no router token): under torchrun a rank
        with fewer micro-batches than another runs it, so every rank joins the same collectives."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        zeros = torch.zeros((1, 1), device=self.device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "targets": ids[:, 1:].clone(),
                "completion_mask": zeros, "old_logprobs": zeros.clone(), "rollout_logprobs": zeros.clone(),
                "advantages": zeros.clone(), "router_mask": torch.zeros_like(ids)}

    def _loss_share(self, mb, rows: float, n_items, num_micro: int):
        """The factor that makes a micro-batch's loss (policy_loss with gradient_accumulation_steps 1) its share of
        the step's, when micro-batches differ in size (torchrun ranks, token-balanced packing): grpo and dr_grpo
        weigh each sequence 1 / (sequences of the step), which is the loss of the whole batch in one micro-batch;
        bnpo the micro-batch's tokens / the step's (the whole batch's token mean) when packed, and under torchrun
        alone the mean over the micro-batches of all ranks (what one process with equal micro-batches gives); dapo
        is normalised by the step's token count already. 1 with equal micro-batches in one process (policy_loss
        divides by their number)."""
        packed = bool(self.cfg.max_tokens_per_micro_batch)
        if not (self.dist.mesh.distributed or packed):
            return 1.0
        kind = self.loss_cfg.loss_type
        if kind in ("grpo", "dr_grpo"):
            return mb["input_ids"].shape[0] / rows
        if kind == "bnpo":
            return mb["completion_mask"].sum() / n_items if packed else 1.0 / (num_micro * self.dist.world_size)
        return 1.0

    def update_phase(self, batch) -> dict:
        """μ optimizer passes over the batch. Metrics accumulate on the device and reach the host once per
        optimizer step (the non-finite guard's check) and once at the end; under torchrun they are the global
        batch's (one all-reduce per pass for the loss, one at the end)."""
        cfg, model, d = self.cfg, self.model, self.dist
        t0 = time.perf_counter()
        micro = self._micro_batches(batch) if batch is not None else []
        real = len(micro)
        if d.mesh.distributed:  # every rank runs as many forwards as the busiest: each gathers weights (FSDP, EP)
            micro += [self._empty_micro_batch() for _ in range(max(d.all_gather_objects(real)) - real)]
        n_items = d.sum(sum(mb["completion_mask"].sum() for mb in micro))
        rows = d.sum_floats(sum(mb["input_ids"].shape[0] for mb in micro[:real]))[0]
        shared = d.mesh.distributed or cfg.max_tokens_per_micro_batch  # _loss_share weighs the micro-batches
        loss_cfg = dataclasses.replace(self.loss_cfg, gradient_accumulation_steps=1 if shared else len(micro))
        replay = cfg.routing_replay == "R3"
        if replay and batch is not None and "routed_experts" not in batch:
            raise RuntimeError("--routing_replay R3: the rollouts came back without routed experts")
        with torch.no_grad():
            for mb in micro:
                if self.ref_model is not None:
                    mb["ref_logprobs"] = self._logprobs(self.ref_model, mb)[0]
        model.train()
        zero = lambda: torch.zeros((), device=self.device)  # noqa: E731
        acc = {"loss": zero(), "aux_loss": zero()}
        mismatch = MismatchMeter(zero)
        grad_norms, lrs = [], []
        for it in range(cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = zero()
            for j, mb in enumerate(micro):
                (lp, ent), router_logits = self._logprobs(model, mb, entropy=True)
                mask = mb["completion_mask"]
                if it == 0:  # the trainer's log-probs at the start of the step: measured, and old for every pass
                    with batch_invariant_mode(cfg.exact_rollouts):  # the top-k the exact decoder takes
                        mismatch.add(lp, mb, router_logits, model.config.num_experts_per_tok)
                    if cfg.old_logprobs == "trainer":
                        mb["old_logprobs"] = lp.detach()
                    if cfg.rollout_correction.enabled:
                        mb["is_weights"], sums = rollout_correction(lp, mb["rollout_logprobs"], mask,
                                                                    cfg.rollout_correction)
                        mismatch.add_sums(sums)
                loss, lm = policy_loss(lp, mb["old_logprobs"], mb["advantages"], mask,
                                       ref_logprobs=mb.get("ref_logprobs"), entropy=ent, num_items_in_batch=n_items,
                                       is_weights=mb.get("is_weights"), config=loss_cfg)
                loss = loss * self._loss_share(mb, rows, n_items, len(micro))
                aux = zero()
                if router_logits and cfg.lambda_aux > 0:
                    # R3: the experts counted are the replayed ones, on the tokens the decoder routed
                    router_mask = mb["routed_mask"] if replay and "routed_experts" in mb else \
                        mb.get("router_mask", mb["attention_mask"])
                    aux = model.load_balancing_loss(router_logits, router_mask, group=d.group,
                                                    routed_experts=mb.get("routed_experts") if replay else None)
                    aux = aux / len(micro)
                    loss = loss + cfg.lambda_aux * aux
                loss.backward()
                step_loss += loss.detach()
                # loss and aux are this micro-batch's share of the step: their sums are the step's
                acc["aux_loss"] += aux.detach()
                for k, v in lm.items():  # means over the real micro-batches
                    acc[k] = acc.get(k, zero()) + v * (j < real)
            grad_norm = d.clip_grad_norm_(self.trainable, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
            step_loss = d.sum(step_loss)  # the global step's, so every rank's guard decides alike
            acc["loss"] += step_loss / d.world_size  # summed over ranks below with the rest
            grad_norms.append(grad_norm)
            lrs.append(self.scheduler.get_last_lr()[0])  # the lr this optimizer step uses
            if self.guard.step(self.optimizer, step_loss, grad_norm, f"step {self.step + 1}, pass {it + 1}") and self.master:
                self.master.copy_to_model()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # the rollouts never share memory with gradients (livemoe.train.plan)
        model.eval()
        if self.infer is not None:  # the rollout decoder's copy follows the update
            d.refresh_copy(model, self.infer)
        keys = sorted(acc)
        totals = dict(zip(keys, d.sum(torch.stack([acc[k].float() for k in keys])).tolist()))
        real_micro = d.sum_floats(real)[0] * cfg.num_iterations
        sums = {k: totals[k] / max(real_micro, 1) for k in keys
                if k not in ("loss", "aux_loss", "log_ratio/clamped")}
        sums["log_ratio/clamped"] = totals["log_ratio/clamped"]  # a count over the step's passes
        sums["loss"] = totals["loss"] / cfg.num_iterations
        sums["aux_loss"] = totals["aux_loss"] / cfg.num_iterations
        sums["grad_norm"] = float(torch.stack(grad_norms).float().mean())
        sums.update(mismatch.metrics(d))
        sums["time/update_s"] = time.perf_counter() - t0
        sums["lr"] = sum(lrs) / len(lrs)  # what the step's passes used (not the next step's, as the scheduler now has)
        sums["nonfinite_steps"] = self.guard.skipped
        return sums

    # -- evaluation ---------------------------------------------------------------------------------
    def evaluate(self, label: str) -> dict:
        """livemoe.train.evaluate on the held-out records (--eval_samples sampled responses per prompt at
        --eval_temperature), one row of the Table-3 table."""
        from livemoe.train.evaluate import evaluate

        # its decoder attaches its own KV cache to the shared attention layers: ours must be released
        # first (it comes back, re-attached, at the next rollout); it releases its own when done
        self.rollouts.release()
        return evaluate(self.infer or self.model, self.tokenizer, self.eval_records, self.judge, self.cfg.eval_max_new_tokens,
                        self.cfg.eval_temperature, self.cfg.seed, progress=False, label=label,
                        samples=self.cfg.eval_samples)

    # -- the loop -----------------------------------------------------------------------------------
    def start_async(self) -> AsyncRollouts:
        """The producer of --async_rollouts, from this step on: in-process it decodes its own copy of the policy,
        with --rollout_url it drives the servers (and pushes each version it loads). Under torchrun every rank runs
        one, on its share of each batch; their gathers and the barrier after rank 0's push run on a process group
        of their own (Distributed.side_channel), and with --rollout_url only rank 0's holds a copy to push."""
        remote = bool(self.cfg.rollout_url)
        comm = self.dist.side_channel()
        model = AsyncRollouts.decoder_copy(self.infer or self.model) if self.dist.is_main or not remote else None
        if remote:
            rollouts = self.rollouts
            rollouts.barrier = comm.barrier  # every rank's next rollouts wait for rank 0's push, off the trainer's group
        else:
            rollouts = Rollouts(model, self.tokenizer, num_generations=self.cfg.num_generations,
                                max_new_tokens=self.cfg.max_new_tokens, seed=self.cfg.seed,
                                return_routed_experts=self.model.num_moe_layers > 0, **self._sampling())
        self.rollouts.release()
        return AsyncRollouts(functools.partial(self.sample_groups, comm=comm), rollouts, model, first_step=self.step,
                             total_steps=self.total_steps, max_staleness=self.cfg.max_staleness, push_weights=remote,
                             partial=self.cfg.partial_rollouts)

    def train_step(self, step: int, producer: AsyncRollouts | None = None) -> dict:
        """One step: its rollouts (rolled out now, or taken from the --async_rollouts producer), the update, and
        the new weights to the rollouts (pushed, or published to the producer)."""
        t0 = time.perf_counter()
        if producer is None:
            batch, m = self.rollout_phase(step)
        else:
            out = producer.get(step)
            waited = time.perf_counter() - t0
            batch, m = self.make_batch(out)
            comps = [c for g in out["sampled"] for c in g["comps"] or ()]
            versions = [v for c in comps for v in c.versions]
            # the producer never rolls out with a version older than step - S: nothing to drop
            assert step - out["version"] <= self.cfg.max_staleness, (step, out["version"])
            m.update({"async/version": out["version"], "async/staleness": step - out["version"],
                      "async/staleness_mean": step - sum(versions) / max(len(versions), 1),
                      "async/interrupted_frac": sum(len(set(c.versions)) > 1 for c in comps) / max(len(comps), 1),
                      "time/rollout_wait_s": waited})
        if not self.dist.sum_floats(int(batch is not None))[0]:  # every group had zero variance and was dropped
            m.update({"skipped_update": 1})
        else:
            m.update(self.update_phase(batch))
            if producer is None:
                self.rollouts.weights_updated(self.infer or self.model)
        if producer is not None:
            producer.publish(step + 1, self.infer or self.model)
        tokens = self.dist.sum_floats(0.0 if batch is None else float(batch["completion_mask"].sum()))[0]
        m["tokens_per_s"] = tokens / max(m["time/rollout_s"] + m.get("time/update_s", 0.0), 1e-9)
        m["time/step_s"] = time.perf_counter() - t0
        return m

    def trained_model(self):
        """A context giving the model with its trained weights: the fp32 masters under bf16 (what checkpoints
        and the export hold, so a resumed run continues from them exactly), else the model itself."""
        return self.master.fp32_model() if self.master else contextlib.nullcontext(self.model)

    def save(self, step: int) -> str:
        """An atomic checkpoint: one process's HF-layout one, or under torchrun the sharded one."""
        with self.trained_model() as model:
            return self.dist.save_checkpoint(self.ckpt_root, step, model, self.optimizer, self.scheduler,
                                             {"ref_lengths": self.ref_lengths, "start_model": self.start_model,
                                              "before": self.before, "nonfinite_steps": self.guard.skipped},
                                             self.cfg.keep_last,
                                             save_model=lambda m, p: save_model(m, p, tokenizer=self.tokenizer))

    def _loop(self, producer) -> dict | None:
        cfg, last = self.cfg, None
        while self.step < self.total_steps:
            m = self.train_step(self.step, producer)
            self.step += 1
            self.metrics.log(self.step, **m)
            last = m
            if cfg.progress and (self.step % cfg.log_every == 0 or self.step == self.total_steps):
                print(f"step {self.step}/{self.total_steps} reward {float(m['reward/mean']):.3f} "
                      f"tpr {float(m['tpr/mean']):.1f} correct {float(m.get('reward/correct/mean', 0)):.2f} "
                      f"helpful {float(m.get('reward/helpful/mean', 0)):.2f} len_r {float(m['reward/length/mean']):.2f} "
                      f"kl {float(m.get('kl', 0)):.4f} |dlogp| {float(m.get('logprob_diff/max', 0)):.1e} "
                      f"({m['time/rollout_s']:.1f}+{m.get('time/update_s', 0):.1f}s)", flush=True)
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < self.total_steps:
                self.save(self.step)
        return last

    def train(self, evaluate: bool = True) -> dict:
        cfg = self.cfg
        evaluate = evaluate and bool(self.eval_records)  # --eval_rooms 0 (no --eval_data): no table
        evaluate = evaluate and self.dist.is_main  # under torchrun rank 0 evaluates its gathered copy
        if self.dist.is_main:
            save_config(cfg, cfg.output_dir)
        self.compute_reference_lengths()
        if evaluate and self.before is None:
            self.before = self.evaluate("start (RFT student)")
            print(f"before: {_brief(self.before)}", flush=True)
        t_start = time.time()
        last = None
        producer = self.start_async() if cfg.async_rollouts and self.step < self.total_steps else None
        try:
            last = self._loop(producer)
        finally:
            if producer is not None:
                producer.close()
        self.save(self.step)
        export = cfg.export_dir or os.path.join(cfg.output_dir, "final")
        if self.dist.mesh.distributed:
            self.dist.export(self.model, export, self.tokenizer)  # gathered, written by rank 0
            self.dist.close()
        else:
            with self.trained_model() as model:
                save_model(model, export, tokenizer=self.tokenizer)
        self.metrics.close(plot=cfg.plot)
        summary = {"steps": self.step, "train_minutes": (time.time() - t_start) / 60, "export": export,
                   "start_model": self.start_model, "last": {k: float(v) for k, v in (last or {}).items()}}
        if evaluate:
            from livemoe.train.evaluate import write_eval

            after = self.evaluate("+ GRPO")
            summary.update(before=_brief(self.before), after=_brief(after), **tpr_change(self.before, after))
            table = write_eval(cfg.output_dir, [self.before, after])  # eval_table.md, eval.json
            print(f"\n{table}\n{summary['change']}\n", flush=True)
        if self.dist.is_main:
            with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
                json.dump(_rounded(summary), f, indent=1)
        return summary


def _reward_spread(group: dict) -> bool:
    """Whether a group's rewards differ (multi-turn: its trajectories' mean turn rewards): group_advantages' test."""
    r = [sum(x) / len(x) if isinstance(x, list) else x for x in group["rewards"]]
    return len(r) > 1 and float(torch.tensor(r, dtype=torch.float32).std()) >= ZERO_STD


def _add_components(values: dict, results: list) -> None:
    """Appends each reward result's components (correct, helpful, length, user functions) to values[name]."""
    for x in results:
        for k, v in x.components.items():
            values.setdefault(k, []).append(v)


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return round(x, 6) if isinstance(x, float) else x


def _brief(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "samples"}


def tpr_change(before: dict, after: dict) -> dict:
    """TPR reduction (%) and the quality changes in points, the figures the seed's Table 3 compares."""
    q = ("em", "f1") if "em" in before else ("correct", "helpful")
    drop = 100.0 * (1 - after["tpr"] / before["tpr"]) if before["tpr"] else float("nan")
    out = {"tpr_reduction_pct": drop, **{f"{k}_change_points": after[k] - before[k] for k in q}}
    out["change"] = (f"TPR {before['tpr']:.1f} -> {after['tpr']:.1f} ({drop:.1f}% shorter); " +
                     ", ".join(f"{k} {before[k]:.1f} -> {after[k]:.1f} ({after[k] - before[k]:+.1f} points)" for k in q))
    return out

