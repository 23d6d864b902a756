"""SM-GSPO: streaming multi-turn GSPO. The policy plays whole sessions of the world: at each interval
it decodes one decision (held to the decision grammar, as a LiveSession is) from a context that holds
its own earlier decisions (its MEM notes and answers), with K trajectories per session
(train.rollout.Rollouts.generate_multi_turn on the engine's decoder, the same module: no weight copy).

Rewards (train.live.judge): per turn, the weighted state / recipient / task / grounding score of the
decision; per trajectory, questions answered in time minus spam and contradictions per interval.
Advantages mix both (train.advantages.multi_turn_advantages): turn_weight * A_turn + (1 - turn_weight)
* A_trajectory, A_turn normalised across the group's K trajectories at the same interval.

Field credit (field_credit, the default): a MEM or ANS decision is two parts, its head (the marker and
fields, "ANS @amy answer: " or "MEM ") and its body (the message and the end token); an OBS decision is
all head. The head is credited by the head reward (state, recipient and task, weighted as in the turn
reward and renormalised), the body by the grounding (the state where there is none): each has its own
turn advantage (normalised across the K trajectories at the interval), both the same trajectory
credit. Without it a right recipient shares the sign of a wrong message, and its one or two tokens
weigh 1/40 of a turn's ratio; with it they weigh about 1/6 of the head's and answer to what they decide.

Importance ratios are sequence-level per part (GSPO on each decision's head and body; per turn without
field credit): every part of every trajectory is one row of train.losses.policy_loss with
importance_sampling_level="sequence", so a part's ratio is exp(mean over its tokens of logprobs -
old_logprobs). Log-probs come from the fused kernel
(kernels.logprobs.fused_linear_logprobs); old_logprobs are the trainer's own before the update.
"""
import time
from dataclasses import dataclass

import torch

from engine.live.decision import TASKS, DecisionFormatError, max_decision_chars, parse_decision
from engine.live.layout import encode, interval_segment, render_events, system_segment
from engine.live.session import decision_constraint
from kernels.logprobs import fused_linear_logprobs
from train.advantages import multi_turn_advantages, token_advantages
from train.live.data import interval_time
from train.live.judge import accuracy, score_session
from train.live.msft import field_chars
from train.live.options import StageOptions
from train.losses import policy_loss
from train.nonfinite import NonFiniteGuard
from train.rollout import Rollouts, collate


@dataclass(kw_only=True)
class GSPOOptions(StageOptions):
    steps: int = 24
    sessions_per_step: int = 2
    num_generations: int = 8
    num_iterations: int = 2  # updates per rollout batch (the ratio moves off 1 from the second)
    temperature: float = 1.0
    lr: float = 3e-4
    turn_weight: float = 0.7
    epsilon_low: float = 3e-4  # GSPO's sequence-level clip range
    epsilon_high: float = 4e-4
    reward_weights: tuple = (0.4, 0.2, 0.2, 0.2)  # state, recipient, task, grounding
    field_credit: bool = True  # a decision's head and body as two rows, each with its own reward
    max_message_chars: int = 96

    def __post_init__(self):
        for name in ("steps", "sessions_per_step", "num_generations", "num_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2 (advantages compare trajectories of one session)")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.turn_weight <= 1:
            raise ValueError(f"turn_weight must be in [0, 1], got {self.turn_weight}")


def session_turns(session: dict, tokenizer) -> tuple:
    """(first prompt ids, [ids inserted before each later decision]) of a session in the live layout."""
    segs = [encode(tokenizer, interval_segment(render_events(iv["events"], interval_time(iv, i)), i > 0))
            for i, iv in enumerate(session["intervals"])]
    return encode(tokenizer, system_segment(session["system"])) + segs[0], segs[1:]


def parse_or_none(text: str):
    try:
        return parse_decision(text)
    except DecisionFormatError:
        return None


def rewards_of(sessions: list, groups: list, opts: GSPOOptions, scores_out: list | None = None) -> tuple:
    """(per trajectory the turn rewards, per trajectory the trajectory reward), groups of K in order.
    scores_out, when given, receives per trajectory its turns' judge.IntervalScores."""
    turn_rewards, traj_rewards = [], []
    for session, group in zip(sessions, groups):
        for c in group:
            preds = [parse_or_none(t) for t in c.turn_texts]
            score = score_session(preds, session)
            if scores_out is not None:
                scores_out.append(score.intervals)
            turn_rewards.append([s.reward(opts.reward_weights) for s in score.intervals])
            traj_rewards.append(score.trajectory_reward(len(preds)))
    return turn_rewards, traj_rewards


def part_rewards(score, weights) -> tuple:
    """(head reward, body reward) of one turn's judge.IntervalScore: the weighted state, recipient and
    task (renormalised to [0, 1]); the grounding (the state where the gold has none, as in the reward)."""
    state, recipient, task, grounding = [score.state if x is None else x
                                         for x in (score.state, score.recipient, score.task, score.grounding)]
    head = sum(w * float(x) for w, x in zip(weights[:3], (state, recipient, task))) / sum(weights[:3])
    return head, float(grounding)


def head_tokens(tokenizer, token_ids: list, text: str) -> int:
    """How many of a decision's tokens (token_ids, its end token included) belong to its head: those
    that start in the marker and fields (msft.field_chars); all of them for OBS, which has no message."""
    cut = field_chars(text)
    if cut >= len(text):
        return len(token_ids)
    pos = n = 0
    for t in token_ids:
        if pos >= cut:
            break
        pos += len(tokenizer.decode([t]))
        n += 1
    return n


def split_turns(tokenizer, comp, head_adv: list, body_adv: list) -> tuple:
    """A trajectory's turns cut into head and body parts: ([(start, end)] spans in comp.token_ids, one
    advantage per span); a turn all head (OBS) gives one span."""
    spans, advs = [], []
    for (s, e), text, ah, ab in zip(comp.turn_spans, comp.turn_texts, head_adv, body_adv, strict=True):
        h = s + head_tokens(tokenizer, comp.token_ids[s:e], text)
        spans.append((s, h))
        advs.append(ah)
        if h < e:
            spans.append((h, e))
            advs.append(ab)
    return spans, advs


def turn_rows(batch: dict, turn_ids, num_turns: list) -> tuple:
    """One row per (trajectory, turn): (row -> trajectory index [R], the turn's completion mask [R, T-1])."""
    traj, turn = [], []
    for i, n in enumerate(num_turns):
        traj += [i] * n
        turn += range(1, n + 1)
    traj = torch.tensor(traj)
    turn = torch.tensor(turn, dtype=turn_ids.dtype)
    mask = ((turn_ids[traj] == turn[:, None]) & (batch["completion_mask"][traj] > 0)).float()
    return traj, mask


def per_turn_policy_loss(logprobs, old_logprobs, advantages, traj, mask, opts: GSPOOptions):
    """policy_loss over one row per turn: GSPO's sequence-level ratio on each decision."""
    return policy_loss(logprobs[traj], old_logprobs[traj], advantages[traj], mask,
                       importance_sampling_level="sequence", loss_type="grpo",
                       epsilon_low=opts.epsilon_low, epsilon_high=opts.epsilon_high)


class SMGSPO:
    def __init__(self, model, tokenizer, opts: GSPOOptions, **engine_options):
        self.model, self.tokenizer, self.opts = model, tokenizer, opts
        self.rollouts = Rollouts(model, tokenizer, num_generations=opts.num_generations,
                                 max_new_tokens=max_decision_chars(max_message_chars=opts.max_message_chars) + 1,
                                 temperature=opts.temperature, seed=opts.seed, **engine_options)
        # the decoder's rollouts are held to the decision grammar, as a LiveSession's decisions are
        self.rollouts.sampling.update(decision_constraint(TASKS, opts.max_message_chars))
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr)
        self.guard = NonFiniteGuard(opts.max_nonfinite_steps)
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def rollout(self, sessions: list, step: int) -> list:
        turns = [session_turns(s, self.tokenizer) for s in sessions]
        self.model.eval()
        with torch.no_grad():
            groups = self.rollouts.generate_multi_turn([f for f, _ in turns], [n for _, n in turns], step)
        self.rollouts.release()
        return groups

    def _logprobs(self, batch: dict):
        hidden, router_logits = self.model.forward_hidden(batch["input_ids"], attention_mask=batch["attention_mask"],
                                                          return_router_logits=True)
        lp = fused_linear_logprobs(hidden[:, :-1], self.model.lm_head_weight, batch["targets"], self.opts.temperature,
                                   mask=batch["completion_mask"] > 0)
        return lp, router_logits

    def step(self, sessions: list, step: int) -> dict:
        opts, K = self.opts, self.opts.num_generations
        t0 = time.perf_counter()
        groups = self.rollout(sessions, step)
        t_roll = time.perf_counter() - t0
        comps = [c for g in groups for c in g]
        scores = []
        turn_rewards, traj_rewards = rewards_of(sessions, groups, opts, scores)
        if opts.field_credit:
            parts = [[part_rewards(x, opts.reward_weights) for x in traj] for traj in scores]
            adv_head, adv_body = (multi_turn_advantages([[p[j] for p in traj] for traj in parts], K, opts.turn_weight,
                                                        trajectory_rewards=traj_rewards) for j in (0, 1))
            spans, advs = zip(*(split_turns(self.tokenizer, c, ah, ab) for c, ah, ab in zip(comps, adv_head, adv_body)))
        else:
            spans = [c.turn_spans for c in comps]
            advs = multi_turn_advantages(turn_rewards, K, opts.turn_weight, trajectory_rewards=traj_rewards)
        token_adv = [token_advantages(sp, a, len(c.token_ids))[0] for c, sp, a in zip(comps, spans, advs)]
        batch = collate(comps, token_adv, self.pad_id)
        # the same collation with each part's number for an advantage: which part a position belongs to
        numbers = [token_advantages(sp, list(range(1, len(sp) + 1)), len(c.token_ids))[0] for c, sp in zip(comps, spans)]
        turn_ids = collate(comps, numbers, self.pad_id)["advantages"].round().long()
        batch = {k: v.to(self.device) for k, v in batch.items()}
        traj, mask = turn_rows(batch, turn_ids.to(self.device), [len(sp) for sp in spans])
        with torch.no_grad():
            old = self._logprobs(batch)[0]
        self.model.train()
        stats = {}
        for it in range(opts.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            lp, router_logits = self._logprobs(batch)
            loss, lm = per_turn_policy_loss(lp, old, batch["advantages"], traj, mask, opts)
            aux = torch.zeros((), device=self.device)
            if router_logits and opts.lambda_aux > 0:
                aux = self.model.load_balancing_loss(router_logits, batch["attention_mask"])
            total = loss + opts.lambda_aux * aux
            total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), opts.max_grad_norm)
            self.guard.step(self.optimizer, float(total.detach()), grad_norm, f"SM-GSPO step {step + 1}, pass {it + 1}")
            stats = {"loss": float(loss.detach()), "ratio": float(lm["ratio/mean"]), "clip": float(lm["clip_ratio/region_mean"]),
                     "grad_norm": float(grad_norm)}
        self.model.eval()
        flat = [r for t in turn_rewards for r in t]
        acc = accuracy([x for traj in scores for x in traj])
        # "reward/..." keys: the metrics logger draws them as the lead page's reward panel
        return {"step": step + 1, "turn_reward": sum(flat) / len(flat),
                "trajectory_reward": sum(traj_rewards) / len(traj_rewards),
                "reward/mean": sum(flat) / len(flat),
                **{f"reward/{k}/mean": acc[k] / 100 for k in ("state", "recipient", "task", "grounding")},
                "parsed": sum(parse_or_none(t) is not None for c in comps for t in c.turn_texts) / len(flat),
                **stats, "time/rollout_s": t_roll, "time_s": time.perf_counter() - t0}


def train_gspo(model, tokenizer, sessions: list, opts: GSPOOptions, log=print, on_step=None,
               **engine_options) -> dict:
    trainer = SMGSPO(model, tokenizer, opts, **engine_options)
    rng = torch.Generator().manual_seed(opts.seed)
    history = []
    log(f"SM-GSPO: {opts.steps} steps x {opts.sessions_per_step} sessions x {opts.num_generations} trajectories")
    for step in range(opts.steps):
        idx = torch.randint(len(sessions), (opts.sessions_per_step,), generator=rng).tolist()
        row = trainer.step([sessions[i] for i in idx], step)
        history.append(row)
        if on_step is not None:
            on_step(step + 1, row)
    return {"steps": opts.steps, "history": history}
