"""Issue 32's experiment: GRPO with bf16 rollouts and an fp32 trainer (`--rollout_dtype bfloat16 --bf16 false`), the
decoder and the trainer disagreeing as a bf16 inference engine and an fp32 trainer do, run four ways:
- plain: the policy ratio against the rollout's log-probs, nothing corrected (`--old_logprobs decoder
  --rollout_is none`, the default before issue 32);
- TIS: the trainer's own old log-probs and token-level truncated importance weights at 2.0 (today's default);
- R3: the rollout's routing replayed in the trainer's forward, otherwise plain;
- R3 + TIS;
- exact: the exact on-policy mode (`--exact_rollouts`), bf16 rollouts and a trainer whose forward also runs in bf16
  (fp32 master weights), every op batch-invariant on both sides, so the mismatch is 0 by construction (the trainer
  cannot compute in fp32 and agree with a bf16 decoder bit for bit); on the CPU, where its kernels are.
Reported: the mismatch metrics (livemoe/train/mismatch.py) averaged over the steps, the reward over the last steps,
the held-out rows."""
from experiments.common import (FULL_GRPO, GRPO_SIZE_NOTE, TINY_GRPO, TINY_RFT, ExperimentArgs, logged, plot_panels,
                                rft_start, run_grpo, write_report)

NAME = "rollout_mismatch"
TITLE = ("GRPO with bf16 rollouts and an fp32 trainer: plain, TIS, R3, R3 + TIS; and the exact mode (mismatch "
         "metrics, reward)")
USES_START = True
FULL = FULL_GRPO  # 40 steps of 4 prompts x 8 rollouts: four arms x three seeds in ~15 minutes of the 2-core CPU
SEEDS = (0, 1, 2)  # --tiny: --seed alone
MISMATCHED = ["--bf16", "false", "--rollout_dtype", "bfloat16"]
PLAIN = ["--old_logprobs", "decoder", "--rollout_is", "none"]
ARMS = [("plain", "plain", [*MISMATCHED, *PLAIN]), ("TIS (token, truncate 2.0)", "tis", MISMATCHED),
        ("R3", "r3", [*MISMATCHED, *PLAIN, "--routing_replay", "R3"]),
        ("R3 + TIS", "r3_tis", [*MISMATCHED, "--routing_replay", "R3"]),
        ("exact (bf16 both sides)", "exact", ["--bf16", "true", "--exact_rollouts", "true", "--device", "cpu"])]
COLUMNS = ["Arm", "Seeds", "mean abs dlogp", "max abs dlogp", "k3 KL", "Routing disagreement",
           "Reward, last 5 steps (min-max over seeds)", "Largest grad norm", "Correct.", "Helpful.", "TPR"]
DECIMALS = {"mean abs dlogp": 4, "max abs dlogp": 3, "k3 KL": 6, "Routing disagreement": 4, "Largest grad norm": 2}
KEYS = ("logprob_diff/mean", "logprob_diff/max", "mismatch/k3_kl", "mismatch/routing_disagreement", "reward/mean",
        "grad_norm")


def mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run(args: ExperimentArgs) -> str:
    start, rft_arm = rft_start(args, TINY_RFT if args.tiny else [])
    seeds = (args.seed,) if args.tiny else SEEDS
    runs = {slug: [] for _, slug, _ in ARMS}  # arm -> one Arm per seed
    for seed in seeds:
        shared: dict = {}  # L_ref and the start's held-out row: the same for every arm of a seed
        for _, slug, flags in ARMS:
            runs[slug].append(run_grpo(args, f"{slug}_seed{seed}", start, TINY_GRPO if args.tiny else FULL,
                                       [*flags, "--seed", seed], shared))
    before = runs["plain"][0].result["before"]
    rows = [["none (the start)", "-", "-", "-", "-", "-", "-", "-", before["correct"], before["helpful"], before["tpr"]]]
    rewards, routing = {}, {}
    for label, slug, _ in ARMS:
        per_seed = [{k: [v for _, v in logged(arm, k)] for k in KEYS} for arm in runs[slug]]
        pooled = {k: [v for values in per_seed for v in values[k]] for k in KEYS}
        last = [mean(values["reward/mean"][-5:]) for values in per_seed]
        after = {k: mean([arm.result["after"][k] for arm in runs[slug]]) for k in ("correct", "helpful", "tpr")}
        rows.append([label, len(seeds), mean(pooled["logprob_diff/mean"]), max(pooled["logprob_diff/max"]),
                     mean(pooled["mismatch/k3_kl"]), mean(pooled["mismatch/routing_disagreement"]),
                     f"{mean(last):.3f} ({min(last):.3f}-{max(last):.3f})", max(pooled["grad_norm"]),
                     after["correct"], after["helpful"], after["tpr"]])
        steps = [s for s, _ in logged(runs[slug][0], "reward/mean")]
        rewards[label] = (steps, [mean(vs) for vs in zip(*(v["reward/mean"] for v in per_seed))], None)
        routing[label] = (steps, [mean(vs) for vs in zip(*(v["mismatch/routing_disagreement"] for v in per_seed))],
                          None)
    png = plot_panels(f"{args.output_dir}/{NAME}.png", "GRPO, bf16 rollouts, fp32 trainer (mean over seeds)", "step",
                      [("reward (mean over rollouts)", rewards), ("routing disagreement (share of tokens)", routing)])
    notes = f"""Every arm starts from `{start}` with the same prompts, seeds {", ".join(map(str, seeds))}, decodes its rollouts
on a bf16 copy of the policy (refreshed after each optimizer step) and trains the fp32 weights in fp32. The
mismatch columns compare the decoder's sampled-token log-probs with the trainer's at the start of each step, over
every step of every seed (mean; max: the largest of any step); routing disagreement is the share of tokens (prompt
and completion) whose top-k experts differ in at least one MoE layer between the bf16 decoder and the fp32
trainer's own router: under R3 the trainer runs the decoder's experts anyway, the metric says what it would have
picked. The exact arm decodes in bf16 too but its trainer computes in bf16 (fp32 master weights), both sides on
the batch-invariant kernels (`--exact_rollouts`, docs/training.md): its zeros are bitwise agreement, not rounding.
The held-out columns are means over the seeds ({before['prompts']} rooms x {before['samples_per_prompt']}
responses at τ {before['temperature']} each).

""" + GRPO_SIZE_NOTE
    arms = [arm for slug in runs for arm in runs[slug]]
    return write_report(args, TITLE, COLUMNS, rows, notes, ([rft_arm] if rft_arm else []) + arms, png, DECIMALS)
