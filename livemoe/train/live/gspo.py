"""SM-GSPO: streaming multi-turn GSPO. The policy plays whole sessions of the world: at each interval
it decodes one decision (held to the decision grammar, as a LiveSession is) from a context that holds
its own earlier decisions (its MEM notes and answers), with K trajectories per session
(livemoe.train.rollout.Rollouts.generate_multi_turn on the engine's decoder, the same module: no weight copy).

Rewards (livemoe.train.live.judge): per turn, the weighted state / recipient / task / grounding score of the
decision; per trajectory, questions answered in time minus spam and contradictions per interval.
Advantages mix both (livemoe.train.advantages.multi_turn_advantages): turn_weight * A_turn + (1 - turn_weight)
* A_trajectory, A_turn normalised across the group's K trajectories at the same interval.

Credit (`credit`): which parts of a decision are rows with their own reward and advantage (part_starts).
  field (the default)  the marker ("ANS @", "MEM", "OBS") answers to the state, the recipient's name to
         the recipient, the task (from the space that ends the name) to the task, the message (and the
         end token) to the grounding: each token moves with the one score the judge gives what it
         decides, the three accuracies of the table each on their own tokens. A field the gold decision
         lacks scores as the state (a name where none was due is wrong).
  head   the marker and fields together (the weighted state, recipient and task, renormalised) and the
         message (the grounding): a right name still shares the sign of a wrong task or marker.
  turn   the whole decision, the weighted turn reward: a right recipient shares the sign of a wrong
         message, and its one or two tokens weigh 1/40 of the turn's ratio.
Each part's rewards are normalised across the K trajectories at the same interval, mixed with the one
trajectory credit of its trajectory.

Importance ratios are sequence-level per part (GSPO on each): every part of every trajectory is one
row of livemoe.train.losses.policy_loss with importance_sampling_level="sequence", so a part's ratio is
exp(mean over its tokens of logprobs - old_logprobs). Log-probs come from the fused kernel
(livemoe.kernels.logprobs.fused_linear_logprobs); old_logprobs are the trainer's own before the update
(num_iterations > 1; one pass is on-policy, ratio 1, and skips that forward).
"""
import time
from dataclasses import dataclass

import torch

from livemoe.engine.errors import DecisionFormatError
from livemoe.engine.live.decision import TASKS, max_decision_chars, parse_decision
from livemoe.engine.live.layout import encode, system_segment
from livemoe.engine.live.session import decision_constraint
from livemoe.kernels.logprobs import fused_linear_logprobs
from livemoe.train.advantages import SCALE_REWARDS, multi_turn_advantages, token_advantages
from livemoe.train.config import OptionError
from livemoe.engine.multimodal.media import MultimodalPrompt
from livemoe.train.live import omni
from livemoe.train.live.data import interval_tokens
from livemoe.train.live.judge import accuracy, score_session
from livemoe.train.live.msft import class_weights, field_chars
from livemoe.train.live.options import StageOptions
from livemoe.train.losses import policy_loss
from livemoe.train.nonfinite import NonFiniteGuard
from livemoe.train.rollout import Rollouts, collate

CREDITS = ("turn", "head", "field")
FIELDS = ("state", "recipient", "task", "grounding")


@dataclass(kw_only=True)
class GSPOOptions(StageOptions):
    steps: int = 16  # with 8 sessions each; more did not help (experiments/results/live/table.md) and the default must fit 10 minutes
    sessions_per_step: int = 8
    num_generations: int = 8
    num_iterations: int = 1  # updates per rollout batch (the ratio moves off 1 from the second; GSPO's clip then
    # stops most parts: measured 60-70% clipped at pass 2)
    temperature: float = 1.0
    lr: float = 3e-4
    turn_weight: float = 0.7
    epsilon_low: float = 3e-4  # GSPO's sequence-level clip range
    epsilon_high: float = 4e-4
    reward_weights: tuple = (0.4, 0.2, 0.2, 0.2)  # state, recipient, task, grounding
    credit: str = "field"  # the parts of a decision that are GSPO rows with their own reward (part_starts)
    # advantages scaled by the gold decision's class weight, 0 (none) .. 1 (full). 0: in RL the weight also scales
    # the penalty of whatever the policy did there, so at 1 an ANS where OBS was due costs 0.32x while a missed
    # ANS costs 1-3.9x, and the policy learns to speak up everywhere (state accuracy -5.8, experiments/results/live)
    balance: float = 0.0
    scale_rewards: str = "group"  # livemoe.train.advantages: "group" divides each part's centred rewards by their std
    max_message_chars: int = 96

    def __post_init__(self):
        super().__post_init__()
        self.check_at_least(1, "steps", "sessions_per_step", "num_iterations", "max_message_chars")
        if self.num_generations < 2:
            raise OptionError("num_generations", "must be >= 2 (advantages compare trajectories of one session), "
                                                 f"got {self.num_generations}")
        self.check_positive("temperature", "lr")
        self.check_fraction("turn_weight", "balance")
        self.check_choice("scale_rewards", SCALE_REWARDS)
        self.check_choice("credit", CREDITS)


def session_turns(session: dict, tokenizer, processor=None) -> tuple:
    """(first prompt ids, [ids inserted before each later decision]) of a session in the live layout; with audio /
    video events (processor: the engine's MediaProcessor), each one that holds media is a MultimodalPrompt, its
    media placed from its own first token (livemoe.train.rollout.multi_turn_trajectories)."""
    system = encode(tokenizer, system_segment(session["system"]))
    turns = []
    for i, iv in enumerate(session["intervals"]):
        head = system if i == 0 else []
        ids, placed = interval_tokens(iv, i, tokenizer, processor, len(head))
        turns.append(MultimodalPrompt(head + ids, placed) if placed else head + ids)
    return turns[0], turns[1:]


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


def part_starts(text: str, credit: str) -> list:
    """[(first character, part name)] of a decision's text, in order, under a credit mode:
    turn   the whole decision, one part ("turn")
    head   the marker and fields ("head": "ANS @amy answer: ", "MEM ", all of "OBS") and the message ("body")
    field  the marker ("state": "ANS @", "MEM", "OBS"), the recipient's name ("recipient"), the task from
           the space that ends the name ("task": " answer:"), the message from its space ("grounding")
    A decision the grammar cut short keeps the parts it reached."""
    if credit == "turn":
        return [(0, "turn")]
    if credit == "head":
        cut = field_chars(text) if text.startswith("MEM") or ": " in text[4:] else len(text)
        return [(0, "head")] + ([(cut, "body")] if cut < len(text) else [])
    if text.startswith("MEM "):
        return [(0, "state"), (3, "grounding")]
    if not text.startswith("ANS @"):
        return [(0, "state")]
    out = [(0, "state"), (5, "recipient")]
    name_end = text.find(" ", 5)
    if name_end > 5:
        out.append((name_end, "task"))
        colon = text.find(": ", name_end)
        if colon >= 0:
            out.append((colon + 1, "grounding"))
    return out


def split_tokens(tokenizer, token_ids: list, starts: list) -> list:
    """[(number of tokens, part name)] of a decision's tokens (its end token included, which goes with
    the last part): a token belongs to the part its first character is in; parts without a token drop."""
    counts = [0] * len(starts)
    pos, j = 0, 0
    for t in token_ids:
        while j + 1 < len(starts) and pos >= starts[j + 1][0]:
            j += 1
        counts[j] += 1
        pos += len(tokenizer.decode([t]))
    return [(n, name) for n, (_, name) in zip(counts, starts) if n]


def part_rewards(score, weights) -> dict:
    """Each part's reward of one turn's judge.IntervalScore, by part name: "turn" the weighted turn
    reward; "head" the weighted state, recipient and task (renormalised to [0, 1]) and "body" the
    grounding; per field its own 0/1 (a field the gold decision lacks counts as the state, as in the
    turn reward, so a recipient or message where none was due is wrong)."""
    fields = {f: float(score.state if getattr(score, f) is None else getattr(score, f)) for f in FIELDS}
    head = sum(w * fields[f] for w, f in zip(weights[:3], FIELDS[:3])) / sum(weights[:3])
    return {"turn": score.reward(weights), "head": head, "body": fields["grounding"], **fields}


def split_turns(tokenizer, comp, turn_advs: list, credit: str) -> tuple:
    """A trajectory's turns cut into parts (part_starts): ([(start, end)] spans in comp.token_ids, one
    advantage per span). turn_advs: per turn {part name: advantage}."""
    spans, advs = [], []
    for (s, e), text, adv in zip(comp.turn_spans, comp.turn_texts, turn_advs, strict=True):
        for n, name in split_tokens(tokenizer, comp.token_ids[s:e], part_starts(text, credit)):
            spans.append((s, s + n))
            advs.append(adv[name])
            s += n
        assert s == e, (s, e)
    return spans, advs


def decision_class(interval: dict) -> str:
    """The class an interval's gold decision balances in: its kind, and an ANS's task ("ANS thank")."""
    d = interval["decision"]
    return d["kind"] if d["kind"] != "ANS" else f"ANS {d['task']}"


def part_advantages(scores: list, traj_rewards: list, opts, turn_weights: list | None = None) -> list:
    """Per trajectory, per turn {part name: advantage}: each part name's rewards normalised across the
    group's K trajectories at the same interval, mixed with the trajectory credit
    (livemoe.train.advantages.multi_turn_advantages), times the turn's weight (turn_weights: per trajectory a
    weight per turn, default 1)."""
    names = {"turn": ("turn",), "head": ("head", "body"), "field": FIELDS}[opts.credit]
    rewards = [[part_rewards(x, opts.reward_weights) for x in traj] for traj in scores]
    by_name = {n: multi_turn_advantages([[r[n] for r in traj] for traj in rewards], opts.num_generations,
                                        opts.turn_weight, scale_rewards=opts.scale_rewards,
                                        trajectory_rewards=traj_rewards) for n in names}
    if turn_weights is None:
        turn_weights = [[1.0] * len(traj) for traj in scores]
    return [[{n: w * by_name[n][i][t] for n in names} for t, w in enumerate(turn_weights[i])]
            for i in range(len(scores))]


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
    """policy_loss over one row per turn (or part): GSPO's sequence-level ratio on each; old_logprobs
    None = on-policy (ratio 1)."""
    old = None if old_logprobs is None else old_logprobs[traj]
    return policy_loss(logprobs[traj], old, advantages[traj], mask,
                       importance_sampling_level="sequence", loss_type="grpo",
                       epsilon_low=opts.epsilon_low, epsilon_high=opts.epsilon_high)


class SMGSPO:
    def __init__(self, model, tokenizer, opts: GSPOOptions, class_weight: dict | None = None, **engine_options):
        """class_weight: decision_class -> the weight of its intervals' advantages (default: all 1)."""
        self.model, self.tokenizer, self.opts = model, tokenizer, opts
        self.class_weight = class_weight or {}
        self.rollouts = Rollouts(model, tokenizer, num_generations=opts.num_generations,
                                 max_new_tokens=max_decision_chars(max_message_chars=opts.max_message_chars) + 1,
                                 temperature=opts.temperature, seed=opts.seed, **engine_options)
        # the decoder's rollouts are held to the decision grammar, as a LiveSession's decisions are
        self.rollouts.sampling.update(decision_constraint(TASKS, opts.max_message_chars))
        self.params = omni.trainable_parameters(model, opts.train_projector)
        self.optimizer = torch.optim.AdamW(self.params, lr=opts.lr)
        self.guard = NonFiniteGuard(opts.max_nonfinite_steps)
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def rollout(self, sessions: list, step: int) -> list:
        processor = self.rollouts.llm.media_processor  # the decoder's: the trainer places media as it does
        turns = [session_turns(s, self.tokenizer, processor) for s in sessions]
        self.model.eval()
        with torch.no_grad():
            groups = self.rollouts.generate_multi_turn([f for f, _ in turns], [n for _, n in turns], step)
        self.rollouts.release()
        return groups

    def _logprobs(self, batch: dict, media: list):
        hidden, router_logits = omni.forward_hidden(self.model, batch["input_ids"], batch["attention_mask"], media)
        lp = fused_linear_logprobs(hidden[:, :-1], self.model.lm_head_weight, batch["targets"], self.opts.temperature,
                                   mask=batch["completion_mask"] > 0)
        return lp, router_logits

    def step(self, sessions: list, step: int) -> dict:
        opts = self.opts
        t0 = time.perf_counter()
        groups = self.rollout(sessions, step)
        t_roll = time.perf_counter() - t0
        comps = [c for g in groups for c in g]
        scores = []
        turn_rewards, traj_rewards = rewards_of(sessions, groups, opts, scores)
        weights = [[self.class_weight.get(decision_class(iv), 1.0) for iv in s["intervals"]]
                   for s in sessions for _ in range(opts.num_generations)]
        turn_advs = part_advantages(scores, traj_rewards, opts, weights)
        spans, advs = zip(*(split_turns(self.tokenizer, c, a, opts.credit) for c, a in zip(comps, turn_advs)))
        token_adv = [token_advantages(sp, a, len(c.token_ids))[0] for c, sp, a in zip(comps, spans, advs)]
        batch = collate(comps, token_adv, self.pad_id)
        # the same collation with each part's number for an advantage: which part a position belongs to
        numbers = [token_advantages(sp, list(range(1, len(sp) + 1)), len(c.token_ids))[0] for c, sp in zip(comps, spans)]
        turn_ids = collate(comps, numbers, self.pad_id)["advantages"].round().long()
        batch = {k: v.to(self.device) for k, v in batch.items()}
        media = [c.media for c in comps]
        traj, mask = turn_rows(batch, turn_ids.to(self.device), [len(sp) for sp in spans])
        old = None  # one pass is on-policy: its ratio is exactly 1, no forward needed for old log-probs
        if opts.num_iterations > 1:
            with torch.no_grad():
                old = self._logprobs(batch, media)[0]
        self.model.train()
        stats = {}
        for it in range(opts.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            lp, router_logits = self._logprobs(batch, media)
            loss, lm = per_turn_policy_loss(lp, old, batch["advantages"], traj, mask, opts)
            aux = torch.zeros((), device=self.device)
            if router_logits and opts.lambda_aux > 0:
                aux = self.model.load_balancing_loss(router_logits, batch["attention_mask"])
            total = loss + opts.lambda_aux * aux
            total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, opts.max_grad_norm)
            self.guard.step(self.optimizer, float(total.detach()), grad_norm, f"SM-GSPO step {step + 1}, pass {it + 1}")
            stats = {"loss": float(loss.detach()), "ratio": float(lm["ratio/mean"]), "clip": float(lm["clip_ratio/region_mean"]),
                     "grad_norm": float(grad_norm)}
        self.model.eval()
        part_advs = [a for x in advs for a in x]
        flat = [r for t in turn_rewards for r in t]
        acc = accuracy([x for traj in scores for x in traj])
        # "reward/..." keys: the metrics logger draws them as the lead page's reward panel
        return {"step": step + 1, "turn_reward": sum(flat) / len(flat),
                "trajectory_reward": sum(traj_rewards) / len(traj_rewards),
                "reward/mean": sum(flat) / len(flat),
                **{f"reward/{k}/mean": acc[k] / 100 for k in ("state", "recipient", "task", "grounding")},
                "parsed": sum(parse_or_none(t) is not None for c in comps for t in c.turn_texts) / len(flat),
                # parts whose advantage is not 0: the rest (all K alike at that interval) teach nothing
                "adv_nonzero": sum(abs(a) > 1e-6 for a in part_advs) / len(part_advs),
                **stats, "time/rollout_s": t_roll, "time_s": time.perf_counter() - t0}


def train_gspo(model, tokenizer, sessions: list, opts: GSPOOptions, log=print, on_step=None,
               **engine_options) -> dict:
    # balance > 0: the rare decisions (a thank, a correction, a MEM) weigh as much as the frequent OBS, as in
    # MA-MSFT (off by default: see GSPOOptions.balance)
    class_weight = class_weights([decision_class(iv) for s in sessions for iv in s["intervals"]], opts.balance)
    trainer = SMGSPO(model, tokenizer, opts, class_weight, **engine_options)
    rng = torch.Generator().manual_seed(opts.seed)
    history = []
    log(f"SM-GSPO: {opts.steps} steps x {opts.sessions_per_step} sessions x {opts.num_generations} trajectories, "
        f"class weights { {k: round(v, 3) for k, v in sorted(class_weight.items())} }")
    for step in range(opts.steps):
        idx = torch.randint(len(sessions), (opts.sessions_per_step,), generator=rng).tolist()
        row = trainer.step([sessions[i] for i in idx], step)
        history.append(row)
        if on_step is not None:
            on_step(step + 1, row)
    return {"steps": opts.steps, "history": history}
