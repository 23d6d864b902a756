"""Rollouts for GRPO: K completions per prompt from the engine's decoder running THE module being
trained (`LLM.from_model`: no weight copy; its prefix cache is dropped by the decoder itself when the
weights change). The KV cache is released for the update (`release()`) and comes back at the next
generation, so the update never shares memory with it.

Each completion keeps the decoder's raw log-prob of every sampled token (log_softmax(logits / T)
before top-k/top-p: what the trainer recomputes) as its old_logprobs (the rollout's log-probs: the policy ratio's
old ones with --old_logprobs decoder, else what the mismatch metrics and the rollout correction compare the
trainer's with, livemoe/train/mismatch.py). Sampling is seeded per
(run seed, step, prompt): a resumed run draws the same rollouts.

Multi-turn (LiveAssistant): a trajectory is ONE token sequence built turn by turn: the prompt, the
first completion, then the next user turn's tokens, the next completion, ... The decoder continues
from exactly those tokens, so the trainer scores exactly what the policy saw; `turn_spans` marks the
assistant tokens (everything else is masked out of the loss).
"""
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from livemoe.engine.llm import LLM
from livemoe.engine.multimodal.media import MultimodalPrompt, PlacedMedia, split_media
from livemoe.engine.sampling.params import SamplingParams


@dataclass(slots=True)
class Completion:
    prompt_ids: list
    token_ids: list          # generated tokens, the stop token (EOS) included when it ended the turn
    old_logprobs: list       # decoder raw logprob of each of token_ids
    text: str
    finish_reason: str       # "stop" | "length"
    turn_spans: list = field(default_factory=list)  # multi-turn: [(start, end)] of assistant tokens in token_ids
    turn_texts: list = field(default_factory=list)
    # the decoder's routed experts (numpy [prompt + generated - 1, MoE layers, k]) when the rollouts ask for them
    routed_experts: Any = None
    versions: list = field(default_factory=list)  # async GRPO: per token of token_ids, the policy version that drew it
    media: list = field(default_factory=list)  # multi-turn with audio / video: PlacedMedia in prompt_ids + token_ids

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def length(self) -> int:
        """Tokens per response (TPR): generated tokens, the stop token included (as livemoe.train.evaluate
        counts them); multi-turn: the assistant tokens of all turns."""
        return len(self.token_ids) if not self.turn_spans else sum(e - s for s, e in self.turn_spans)


def derive_seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x3FFFFFFF


class Rollouts:
    """`generate(prompts, step)` -> per prompt a list of K Completions; `greedy(prompts)` -> one each."""

    def __init__(self, model, tokenizer, *, num_generations: int = 8, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, seed: int = 0,
                 return_routed_experts: bool = False, **engine_options):
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        if temperature <= 0:
            raise ValueError(f"rollout temperature must be > 0 (GRPO needs different samples), got {temperature}")
        engine_options.setdefault("use_tqdm", False)
        self.llm = LLM.from_model(model, tokenizer, **engine_options)
        self.tokenizer = tokenizer
        self.k, self.max_new_tokens, self.seed = num_generations, max_new_tokens, seed
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.return_routed_experts = return_routed_experts  # sampled rollouts only (not greedy reference lengths)
        # partial rollouts (async GRPO): called between the engine's steps while generate() runs; it may load new
        # weights with update_weights(), which interrupts the sequences in flight. None: one llm.generate call.
        self.between_steps = None
        self.version = 0  # the policy version the decoder holds (stamped on each token it draws)
        self._progress: dict | None = None  # request -> sample index -> tokens so far (while stepping)
        self._changes: dict = {}  # request -> sample index -> [(tokens so far, new version)]

    @property
    def temperature(self) -> float:
        return self.sampling["temperature"]

    def release(self) -> None:
        """Frees the decoder's KV cache for the update (it comes back at the next generation)."""
        self.llm.release_kv_cache()

    def weights_updated(self, model) -> None:
        """Nothing to push: the decoder runs the trained module itself (livemoe/train/remote_rollout.py pushes)."""

    def _params(self, seed, n, max_tokens, greedy=False):
        if greedy:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
        return SamplingParams(**self.sampling, n=n, max_tokens=max_tokens, seed=seed, logprobs=0,
                              logprobs_mode="raw", return_routed_experts=self.return_routed_experts)

    @staticmethod
    def _completion(prompt_ids, out, versions: list | None = None) -> Completion:
        lps = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        return Completion(list(prompt_ids), list(out.token_ids), lps, out.text, out.finish_reason,
                          routed_experts=out.routed_experts, versions=versions or [])

    def update_weights(self, named_tensors, version: int) -> None:
        """New weights for the decoder's module (a copy the trainer does not update itself). Called from
        between_steps while generate() runs, it interrupts the sequences in flight (the engine's
        in_flight="interrupt"): they resume on the new weights where they stopped, and their tokens from here on
        are `version`'s; their earlier tokens keep their log-probs and version."""
        self.llm.update_weights(named_tensors, in_flight="interrupt" if self._progress is not None else "finish")
        for rid, counts in (self._progress or {}).items():
            for index, count in counts.items():
                self._changes[rid].setdefault(index, []).append((count, version))
        self.version = version

    def _generate_stepwise(self, ids: list, params: list) -> tuple:
        """llm.generate one engine step at a time, calling between_steps() after each; -> (the finished outputs in
        order, per output per sample its tokens' versions)."""
        rids = [self.llm.add_request(p, sp) for p, sp in zip(ids, params)]
        start = self.version
        self._progress = {rid: dict.fromkeys(range(sp.n), 0) for rid, sp in zip(rids, params)}
        self._changes = {rid: {} for rid in rids}
        done: dict = {}
        try:
            while len(done) < len(rids):
                for o in self.llm.step():
                    if o.request_id not in self._progress:
                        continue
                    for c in o.outputs:
                        self._progress[o.request_id][c.index] = len(c.token_ids)
                    if o.finished:
                        done[o.request_id] = o
                        del self._progress[o.request_id]
                failed = {r: why for r, why in self.llm.take_failed().items() if r in self._changes}
                if failed:
                    raise RuntimeError(f"the engine ended rollout request(s): {failed}")
                if len(done) < len(rids):
                    self.between_steps()
        except BaseException:
            for rid in rids:
                self.llm.abort(rid)
            raise
        finally:
            self._progress = None
        versions = []
        for rid in rids:
            per = []
            for c in done[rid].outputs:
                vs = [start] * len(c.token_ids)
                for count, v in self._changes[rid].get(c.index, []):
                    vs[count:] = [v] * (len(vs) - count)
                per.append(vs)
            versions.append(per)
        return [done[r] for r in rids], versions

    def _ids(self, prompt) -> list:
        return self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts: list, step, max_new_tokens: int | None = None, n: int | None = None,
                 keys: list | None = None) -> list:
        """n (default K) samples per prompt, seeded by (run seed, step, key); keys default to the
        prompts' positions."""
        ids = [self._ids(p) for p in prompts]
        n = n or self.k
        keys = range(len(ids)) if keys is None else keys
        params = [self._params(derive_seed(self.seed, step, key) * n, n, max_new_tokens or self.max_new_tokens)
                  for key in keys]
        if self.between_steps is None:
            outs = self.llm.generate(ids, params)
            return [[self._completion(p, c, [self.version] * len(c.token_ids)) for c in o.outputs]
                    for p, o in zip(ids, outs)]
        outs, versions = self._generate_stepwise(ids, params)
        return [[self._completion(p, c, v) for c, v in zip(o.outputs, vs)] for p, o, vs in zip(ids, outs, versions)]

    def greedy(self, prompts: list, max_new_tokens: int | None = None) -> list:
        ids = [self._ids(p) for p in prompts]
        outs = self.llm.generate(ids, self._params(None, 1, max_new_tokens or self.max_new_tokens, greedy=True))
        return [self._completion(p, o.outputs[0]) for p, o in zip(ids, outs)]

    def generate_multi_turn(self, first_prompts: list, next_turns: list, step: int,
                            max_new_tokens: int | None = None, greedy: bool = False, keys: list | None = None) -> list:
        """K trajectories per conversation (see multi_turn_trajectories), each turn one request to the decoder;
        with partial rollouts (between_steps set) each turn runs step by step, a new version interrupting it."""
        max_new = max_new_tokens or self.max_new_tokens

        def sample(prompts: list, seeds: list) -> list:
            params = [self._params(s, 1, max_new, greedy) for s in seeds]
            if self.between_steps is None or greedy:
                outs = self.llm.generate(prompts, params)
                return [self._completion(split_media(p)[0], o.outputs[0]) for p, o in zip(prompts, outs)]
            outs, versions = self._generate_stepwise(prompts, params)
            return [self._completion(split_media(p)[0], o.outputs[0], vs[0])
                    for p, o, vs in zip(prompts, outs, versions)]

        return multi_turn_trajectories(first_prompts, next_turns, step, self.seed, 1 if greedy else self.k, keys,
                                       self._ids, sample)


def multi_turn_trajectories(first_prompts: list, next_turns: list, step: int, seed: int, k: int, keys, ids,
                            sample) -> list:
    """k trajectories per conversation. first_prompts[i]: the prompt up to the first assistant turn;
    next_turns[i]: the token ids (or text) inserted before each later assistant turn (the user turn and the
    assistant header). Returns per conversation k Completions whose token_ids hold all turns and the inserted
    tokens, with turn_spans / turn_texts / old_logprobs (0 on inserted tokens). Samples are seeded by (run seed,
    step, key, sample, turn); keys default to the conversations' positions (under torchrun: their places in the
    global batch, so any split draws the same). ids(prompt) -> token ids; sample(prompts, seeds) -> one
    Completion per prompt (the in-process decoder's, or a rollout server's: the same draws). When the samples
    carry per-token versions (partial rollouts), so do the trajectories: an inserted user turn gets the version of
    the policy that read it (the next turn's first token's).
    Media (a Qwen3-Omni-MoE thinker's live sessions): a first prompt or a next turn may be a MultimodalPrompt, its
    media's offsets counted from its own first token; each trajectory's Completion.media places them in its whole
    sequence (where a later turn lands depends on the lengths sampled before it), and its turns are sampled from
    MultimodalPrompts."""
    if len(first_prompts) != len(next_turns):
        raise ValueError("generate_multi_turn: one list of next turns per conversation")
    if not first_prompts:
        return []
    keys = list(range(len(first_prompts))) if keys is None else list(keys)
    if len(keys) != len(first_prompts):
        raise ValueError(f"generate_multi_turn: {len(keys)} keys for {len(first_prompts)} conversations")
    trajs = []  # (conversation, sample) -> Completion being built
    for i, p in enumerate(first_prompts):
        p, media = split_media(p)
        for j in range(k):
            trajs.append((i, j, Completion(ids(p), [], [], "", "stop", media=list(media or []))))
    num_turns = [1 + len(t) for t in next_turns]
    for turn in range(max(num_turns)):
        live = [(i, j, c) for i, j, c in trajs if turn < num_turns[i]]
        inserted = []
        for i, _, c in live:
            extra, media = split_media(next_turns[i][turn - 1]) if turn > 0 else ([], None)
            start = len(c.prompt_ids) + len(c.token_ids)
            c.media += [PlacedMedia(m.item, start + m.offset) for m in media or []]
            extra = ids(extra) if turn > 0 else []
            c.token_ids += extra
            c.old_logprobs += [0.0] * len(extra)
            inserted.append(len(extra))
        prompts = [MultimodalPrompt(c.prompt_ids + c.token_ids, list(c.media)) if c.media
                   else c.prompt_ids + c.token_ids for _, _, c in live]
        outs = sample(prompts, [derive_seed(seed, step, keys[i], j, turn) for i, j, _ in live])
        for (_, _, c), g, n_inserted in zip(live, outs, inserted):
            if g.versions:
                c.versions += [g.versions[0]] * n_inserted + list(g.versions)
            start = len(c.token_ids)
            c.token_ids += list(g.token_ids)
            c.old_logprobs += list(g.old_logprobs)
            c.turn_spans.append((start, len(c.token_ids)))
            c.turn_texts.append(g.text)
            c.routed_experts = g.routed_experts  # the last turn's cover every token before it
            if g.finish_reason == "length":
                c.finish_reason = "length"
    for _, _, c in trajs:
        c.text = c.turn_texts[-1]
    return [[c for i2, _, c in trajs if i2 == i] for i in range(len(first_prompts))]


def collate(completions: list, advantages, pad_id: int, mask_truncated: bool = False) -> dict:
    """Completions -> right-padded training tensors. Position t of `targets` is predicted by the hidden
    state at t (targets = input_ids shifted by one), so the loss rows are aligned with forward_hidden.

    advantages: one per completion ([N]) or, for multi-turn, one [len(token_ids)] tensor per completion.
    Returns input_ids, attention_mask [N, T]; targets, completion_mask, old_logprobs, advantages
    [N, T-1]; prompt_lens [N] (completion_mask 1 on generated assistant tokens only); when every completion has the decoder's
    routed experts, also routed_experts [N, T, L, k] (rows it has no routing for: experts 0..k-1) and
    routed_mask [N, T] (1 where the decoder's routing is there: every token but the last)."""
    n = len(completions)
    if n == 0:
        raise ValueError("collate: no completions")
    lengths = [len(c.prompt_ids) + len(c.token_ids) for c in completions]
    T = max(lengths)
    input_ids = torch.full((n, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(n, T, dtype=torch.long)
    completion_mask = torch.zeros(n, T - 1)
    old = torch.zeros(n, T - 1)
    adv = torch.zeros(n, T - 1)
    for i, c in enumerate(completions):
        p, g = len(c.prompt_ids), len(c.token_ids)
        input_ids[i, :p + g] = torch.tensor(c.prompt_ids + c.token_ids, dtype=torch.long)
        attention_mask[i, :p + g] = 1
        if mask_truncated and c.truncated:
            continue
        spans = c.turn_spans or [(0, g)]
        for s, e in spans:
            completion_mask[i, p - 1 + s:p - 1 + e] = 1.0
        old[i, p - 1:p - 1 + g] = torch.tensor(c.old_logprobs, dtype=torch.float32)
        a = advantages[i]
        if isinstance(a, torch.Tensor) and a.dim() == 1:
            if a.numel() != g:
                raise ValueError(f"completion {i}: {a.numel()} token advantages for {g} tokens")
            adv[i, p - 1:p - 1 + g] = a
        else:
            adv[i, p - 1:p - 1 + g] = float(a)
    targets = input_ids[:, 1:].clone()
    out = dict(input_ids=input_ids, attention_mask=attention_mask, targets=targets,
               completion_mask=completion_mask, old_logprobs=old * completion_mask, advantages=adv * completion_mask,
               prompt_lens=torch.tensor([len(c.prompt_ids) for c in completions], dtype=torch.long))
    if all(c.routed_experts is not None for c in completions):
        out.update(_collate_routing(completions, T))
    return out


def _collate_routing(completions: list, T: int) -> dict:
    first = completions[0].routed_experts
    _, L, k = first.shape
    routed = torch.arange(k, dtype=torch.from_numpy(first[:0]).dtype).expand(len(completions), T, L, k).clone()
    routed_mask = torch.zeros(len(completions), T, dtype=torch.long)
    for i, c in enumerate(completions):
        rows = len(c.prompt_ids) + len(c.token_ids) - 1
        if c.routed_experts.shape != (rows, L, k):
            raise ValueError(f"completion {i}: routed experts of shape {c.routed_experts.shape}, expected "
                             f"{(rows, L, k)} (prompt + generated tokens - 1, MoE layers, k)")
        routed[i, :rows] = torch.from_numpy(c.routed_experts)
        routed_mask[i, :rows] = 1
    return {"routed_experts": routed, "routed_mask": routed_mask}


def reference_lengths(rollouts: Rollouts, records: list, prompts: list, cache: dict, samples: int = 0,
                      batch: int = 1024) -> dict:
    """L_ref per record id from `rollouts`' model (the starting checkpoint), for the ids missing from
    `cache` (added to it): samples 0 -> the length of its greedy response; samples n >= 1 -> the mean
    length of n responses sampled as the rollouts are (temperature, top-p; seeded by record id), which
    is the scale the rollouts' lengths are compared with. Large batches: a decode step costs about the
    same for 64 or 512 sequences of a small model, and each batch runs as long as its longest answer."""
    todo = [(r["id"], p) for r, p in zip(records, prompts) if r["id"] not in cache]
    for s in range(0, len(todo), batch):
        chunk = todo[s:s + batch]
        prompts_ = [p for _, p in chunk]
        if samples == 0:
            lengths = [[c.length] for c in rollouts.greedy(prompts_)]
        else:
            groups = rollouts.generate(prompts_, "ref", n=samples, keys=[rid for rid, _ in chunk])
            lengths = [[c.length for c in g] for g in groups]
        for (rid, _), ls in zip(chunk, lengths):
            cache[rid] = max(1.0, sum(ls) / len(ls))  # a 0-token reference would leave no interval to aim for
    return cache


def shuffled_order(n: int, seed: int, epoch: int) -> list:
    order = list(range(n))
    random.Random(derive_seed(seed, "epoch", epoch)).shuffle(order)
    return order
