"""GRPOConfig: the options of `python -m train.grpo`, RunConfig's (livemoe.train.config) and GRPO's own: the
rollouts, the policy loss and the rewards. The loss and the reward are their own configs, fields of this one
(cfg.loss: livemoe.train.losses.PolicyLossConfig, cfg.reward: livemoe.train.rewards.RewardConfig), filled by the
flat flags they have always had (--beta, --epsilon, --w_correct, ...), with their own defaults and checks."""
import os
from dataclasses import dataclass, field

from livemoe.train.advantages import SCALE_REWARDS
from livemoe.train.config import (ConfigError, RunConfig, check_at_least, check_choice, check_speculative_config, flag,
                                  nested)
from livemoe.train.losses import PolicyLossConfig
from livemoe.train.mismatch import RolloutCorrectionConfig
from livemoe.train.rewards import RewardConfig, load_reward_fns


@dataclass(kw_only=True)
class GRPOConfig(RunConfig):
    """GRPO options: rollouts, loss, rewards"""
    model: str = field(default="auto", metadata={"help": "checkpoint to start from; auto = the RFT default's student "
                                                        "(running the RFT default first when it is missing)"})
    output_dir: str = "runs/grpo"
    rft_output: str = field(default="", metadata={"help": "where --model auto looks for the RFT student (default: RFT's output_dir)"})
    lr: float = 2e-4
    warmup_steps: int = field(default=2, metadata={"help": "steps of linear lr warm-up, then constant"})
    # 40 (60 before 2026-12-02): the RFT student's TPR is down 39-44% by then, and `make demo` keeps to ~12 minutes
    max_steps: int = field(default=40, metadata={"help": "GRPO steps (a rollout batch, then μ optimizer passes); "
                                                         "0 = --epochs passes over the prompts"})
    batch_size: int = field(default=8, metadata={"help": "prompts per step (each gets --num_generations rollouts)"})
    # rollouts
    num_generations: int = field(default=8, metadata={"help": "K rollouts per prompt, as in the seed"})
    max_new_tokens: int = field(default=256, metadata={"help": "completion length limit of a rollout"})
    temperature: float = field(default=0.7, metadata={"help": "rollout sampling temperature (the seed's τ, as the held-out "
                                                               "answers are sampled)"})
    top_p: float = field(default=1.0, metadata={"help": "rollout nucleus sampling (1 = off)"})
    top_k: int = field(default=-1, metadata={"help": "rollout top-k sampling (-1 = off)"})
    ref_samples: int = field(default=4, metadata={"help": "L_ref = mean length of this many sampled responses of the "
                                                          "starting checkpoint per prompt; 0 = its greedy response"})
    rollout_kv_bytes: int = field(default=256 * 2**20, metadata={"help": "decoder KV-cache budget (CPU)"})
    rollout_max_num_seqs: int = field(default=512, metadata={"help": "sequences the rollout decoder runs at once"})
    rollout_dtype: str = field(default="auto", metadata={"help": "the rollout decoder's dtype: auto (the trainer's "
                                                                 "compute dtype) | bfloat16 | float32 (another one "
                                                                 "decodes a copy refreshed after each step)"})
    rollout_speculative_config: str = field(default="", metadata={
        "help": "speculative decoding of the in-process rollouts, the engine's speculative_config as JSON, e.g. "
                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"disable_by_batch_size\": 64}' (a "
                "seeded ngram rollout gets the tokens it gets without); empty = off"})
    rollout_url: str = field(default="", metadata={"help": "rollout servers (livemoe serve), comma-separated; "
                                                           "empty = the in-process decoder (livemoe/train/remote_rollout.py)"})
    async_rollouts: bool = field(default=False, metadata={
        "help": "roll out the batches of steps t+1..t+S while step t trains (a producer thread: the in-process "
                "decoder on its own copy of the policy, or the --rollout_url servers); each batch comes from "
                "exactly S versions back (livemoe/train/grpo/async_rollouts.py); the rollout correction "
                "(--rollout_is) weighs the gap"})
    max_staleness: int = field(default=1, metadata={"help": "S with --async_rollouts: the policy versions between a "
                                                            "batch's rollouts and its update (0 = the synchronous run)"})
    partial_rollouts: bool = field(default=False, metadata={
        "help": "with --async_rollouts: a new policy version interrupts the rollouts in flight (in-process, or on "
                "the --rollout_url servers, one process), which resume on it where they stopped (each token keeps "
                "its behaviour log-prob and version); fresher samples, but which tokens get which version depends "
                "on timing"})
    weight_sync: str = field(default="distributed", metadata={"help": "with --rollout_url: how new weights reach "
                                                                      "the servers, distributed (broadcast) | disk"})
    # the policy loss, with its defaults but β: the seed's 0.01 where the loss's own is 0 (its max_completion_length,
    # dr_grpo's constant, is --max_new_tokens: the trainer sets it)
    loss: PolicyLossConfig = nested(
        PolicyLossConfig,
        beta=flag("k3 KL weight to the starting checkpoint, as in the seed (0 = no reference model)", default=0.01),
        epsilon=flag("clip ε of the ratio, the low side (and the high side without --epsilon_high), as in the seed",
                     to="epsilon_low"),
        epsilon_high=flag("clip ε of the ratio, the high side (default: --epsilon)", default=None,
                          none_means="epsilon"),
        delta=flag("dual clip c for negative advantages (none = no dual clip)"),
        loss_type=flag("grpo | bnpo | dr_grpo | dapo"),
        importance_sampling_level=flag("token | sequence (GSPO)"))
    num_iterations: int = field(default=1, metadata={"help": "μ: optimiser passes per rollout batch"})
    micro_batch_size: int | None = field(default=None, metadata={
        "help": "completions per forward/backward (default 32; not with --max_tokens_per_micro_batch, which sizes "
                "the micro-batches by tokens instead)"})
    prompt_sharing: bool = field(default=True, metadata={
        "help": "the update's forwards compute each prompt once for its K completions (packed rows, a completion "
                "sees the prompt and itself: livemoe/train/shared_prefix.py); the same log-probs and losses; off "
                "with --routing_replay R3 or --exact_rollouts, and for a micro-batch whose attention pattern would "
                "be too large"})
    max_tokens_per_micro_batch: int = field(default=0, metadata={
        "help": "token-balanced micro-batches: rows packed so that rows x longest row stays within this many tokens "
                "(livemoe/train/packing.py), instead of --micro_batch_size rows; the loss is the same; 0 = off"})
    scale_rewards: str = field(default="group", metadata={"help": "group | batch | none"})
    advantage_eps: float = field(default=1e-4, metadata={"help": "added to the reward std when advantages are normalised"})
    drop_zero_variance: bool = field(default=False, metadata={"help": "leave groups with equal rewards out of the loss"})
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "DAPO's dynamic sampling: groups with equal rewards are dropped and more prompts are rolled out "
                "(--batch_size groups a round) until --batch_size groups with a reward spread are kept, at most "
                "--dynamic_sampling_rounds rounds"})
    dynamic_sampling_rounds: int = field(default=4, metadata={"help": "cap on the generation rounds of one step "
                                                                      "with --dynamic_sampling"})
    mask_truncated: bool = field(default=False, metadata={"help": "leave completions cut at max_new_tokens out of the loss"})
    # trainer (since issue 32): the policy ratio is against the trainer's own log-probs at the start of the step
    # (its first pass's forward, no extra one); the rollout's mismatch goes to the rollout correction below
    old_logprobs: str = field(default="trainer", metadata={"help": "trainer (its log-probs at the start of the step) "
                                                                   "| decoder (the sampled tokens' raw logprobs)"})
    routing_replay: str = field(default="none", metadata={"help": "none | R3: the policy's and reference's forward "
                                                                  "run the rollout's routed experts (MoE)"})
    exact_rollouts: bool = field(default=False, metadata={
        "help": "exact on-policy mode: the decoder and the trainer's forwards run the batch-invariant kernels, so the "
                "rollout's log-probs equal the trainer's bit for bit (R3 and the rollout correction change nothing); "
                "CPU (C++) or CUDA (Triton), one process, the in-process decoder in the trainer's dtype"})
    # TIS at verl's recommended token truncation 2.0 (livemoe/train/mismatch.py; docs/training.md says why)
    rollout_correction: RolloutCorrectionConfig = nested(
        RolloutCorrectionConfig,
        rollout_is=flag("rollout importance weights: token | sequence | none", to="level"),
        rollout_is_threshold=flag("cap C of the rollout importance weights", to="threshold"),
        rollout_is_mode=flag("weights above C: truncate (to C) | mask (to 0)", to="mode"),
        rollout_rs=flag("reject sequences whose geometric-mean ratio is outside [1/B, B]; 0 = off", to="rs_bound"))
    # the rewards (the seed's Table 2: RewardConfig's defaults)
    reward: RewardConfig = nested(
        RewardConfig,
        w_correct=flag("reward weight of correctness, as in the seed"),
        w_helpful=flag("reward weight of helpfulness, as in the seed"),
        w_length=flag("reward weight of the length reward, as in the seed"),
        lambda_upper=flag("length reward: upper end of the target band, a fraction of L_ref, as in the seed"),
        lambda_lower=flag("length reward: lower end of the target band, a fraction of L_ref, as in the seed"),
        length_epsilon=flag("ε of the length reward, a fraction of L_ref"),
        reward_fns=flag("extra rewards: module:fn[=weight],... fn(record, completion, info)"))
    # multi-turn (LiveAssistant)
    multi_turn: bool = field(default=False, metadata={"help": "records' `followups` are later turns of one trajectory"})
    turn_weight: float = field(default=0.5, metadata={"help": "turn-level vs trajectory-level credit"})
    export_dir: str = field(default="", metadata={"help": "HF export of the final model (default: <output_dir>/final)"})

    def check_model(self) -> None:
        if self.model != "auto":  # `auto` is resolved later, by resolve_start
            super().check_model()

    def validate(self) -> None:
        super().validate()
        check_at_least(self, 0, "ref_samples", "max_tokens_per_micro_batch")
        # None until here, so that an explicit --micro_batch_size with --max_tokens_per_micro_batch is told apart
        # from the default (it would be ignored: the rows are grouped by tokens)
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch:
            raise ConfigError("--micro_batch_size and --max_tokens_per_micro_batch both size the micro-batches (rows, "
                              "or tokens): give one of them")
        if self.micro_batch_size is None and not self.max_tokens_per_micro_batch:
            self.micro_batch_size = 32
        check_at_least(self, 1, "num_generations", "max_new_tokens", "num_iterations", "rollout_max_num_seqs",
                       "rollout_kv_bytes", *(["micro_batch_size"] if self.micro_batch_size is not None else []))
        check_at_least(self, 1, "dynamic_sampling_rounds")
        check_at_least(self, 0, "max_staleness")
        if self.partial_rollouts and not self.async_rollouts:
            raise ConfigError("--partial_rollouts interrupts the asynchronous rollouts: add --async_rollouts")
        if self.max_staleness != 1 and not self.async_rollouts:  # 1 is the default: not an ignored choice
            raise ConfigError("--max_staleness is for --async_rollouts: add it, or leave --max_staleness out")
        if self.dynamic_sampling_rounds != 4 and not self.dynamic_sampling:  # 4 is the default
            raise ConfigError("--dynamic_sampling_rounds caps --dynamic_sampling's rounds: add --dynamic_sampling, or "
                              "leave --dynamic_sampling_rounds out")
        if self.num_generations < 2:
            raise ConfigError("--num_generations must be >= 2: GRPO compares rollouts of one prompt")
        if self.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0 for rollouts, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")
        check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        check_choice("old_logprobs", self.old_logprobs, ("decoder", "trainer"))
        check_choice("routing_replay", self.routing_replay, ("none", "R3"))
        check_choice("rollout_dtype", self.rollout_dtype, ("auto", "bfloat16", "float32"))
        if self.rollout_url and self.rollout_dtype != "auto":
            raise ConfigError("--rollout_dtype with --rollout_url: the servers decode in their own --dtype; set it there")
        if self.rollout_correction.enabled and self.old_logprobs == "decoder":
            raise ConfigError("--rollout_is / --rollout_rs weigh the trainer's old log-probs against the rollout's; "
                              "with --old_logprobs decoder the policy ratio is against the rollout's already: use "
                              "--old_logprobs trainer, or --rollout_is none --rollout_rs 0")
        if self.exact_rollouts and self.rollout_url:
            raise ConfigError("--exact_rollouts needs the in-process decoder (the trainer's own kernels); leave out "
                              "--rollout_url")
        if self.exact_rollouts and self.rollout_dtype != "auto":
            raise ConfigError("--exact_rollouts: the decoder runs the trainer's module in the trainer's dtype; leave "
                              "--rollout_dtype auto")
        check_choice("weight_sync", self.weight_sync, ("distributed", "disk"))
        if self.rollout_speculative_config:
            if self.rollout_url:
                raise ConfigError("--rollout_speculative_config is for the in-process decoder; with --rollout_url "
                                  "start the servers with --speculative-config")
            check_speculative_config("rollout_speculative_config", self.rollout_speculative_config)
        if not 0 <= self.turn_weight <= 1:
            raise ConfigError(f"--turn_weight must be in [0, 1], got {self.turn_weight}")
        if self.advantage_eps <= 0:
            raise ConfigError(f"--advantage_eps must be > 0, got {self.advantage_eps}")
        if self.model != "auto" and not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ConfigError(f"--model {self.model}: not a checkpoint directory (no config.json)")
        try:  # the loss and the reward checked their own values when they were made
            load_reward_fns(self.reward.reward_fns)  # a bad dotted path fails here, not at the first step
        except ValueError as e:  # RewardError, or a bad path
            raise ConfigError(str(e)) from None
