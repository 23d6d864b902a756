"""Issue 32's experiment: GRPO with bf16 rollouts and an fp32 trainer (`--rollout_dtype bfloat16 --bf16 false`), the
decoder and the trainer disagreeing as a bf16 inference engine and an fp32 trainer do, run four ways:
- plain: the policy ratio against the rollout's log-probs, nothing corrected (`--old_logprobs decoder
  --rollout_is none`, the default before issue 32);
- TIS: the trainer's own old log-probs and token-level truncated importance weights at 2.0 (today's default);
- R3: the rollout's routing replayed in the trainer's forward, otherwise plain;
- R3 + TIS.
The exact mode (bitwise agreement) is not built yet, so it is not an arm. Reported: the mismatch metrics
(livemoe/train/mismatch.py) averaged over the steps, the reward over the last steps, the held-out rows."""
from experiments.common import GRPO_SIZE_NOTE, TINY_GRPO, TINY_RFT, ExperimentArgs, logged, plot_panels, rft_start, \
    run_grpo, write_report

NAME = "rollout_mismatch"
TITLE = "GRPO with bf16 rollouts and an fp32 trainer: plain, TIS, R3, R3 + TIS (mismatch metrics, reward)"
USES_START = True
# 30 steps of 4 prompts x 8 rollouts at the default lr (FULL_GRPO's shape, 3/4 of its steps): four arms in
# about 20 minutes of the shared 2-core CPU
FULL = ["--max_steps", "30", "--batch_size", "4", "--eval_samples", "2"]
MISMATCHED = ["--bf16", "false", "--rollout_dtype", "bfloat16"]
PLAIN = ["--old_logprobs", "decoder", "--rollout_is", "none"]
ARMS = [("plain", "plain", PLAIN), ("TIS (token, truncate 2.0)", "tis", []),
        ("R3", "r3", [*PLAIN, "--routing_replay", "R3"]), ("R3 + TIS", "r3_tis", ["--routing_replay", "R3"])]
COLUMNS = ["Arm", "|dlogp| mean", "|dlogp| max", "k3 KL", "Routing disagreement", "Reward (last 5 steps)",
           "Correct.", "Helpful.", "TPR"]
DECIMALS = {"|dlogp| mean": 4, "|dlogp| max": 3, "k3 KL": 6, "Routing disagreement": 4, "Reward (last 5 steps)": 3}


def mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run(args: ExperimentArgs) -> str:
    start, rft_arm = rft_start(args, TINY_RFT if args.tiny else [])
    shared: dict = {}
    arms = [run_grpo(args, slug, start, TINY_GRPO if args.tiny else FULL, [*MISMATCHED, *flags], shared)
            for _, slug, flags in ARMS]
    before = arms[0].result["before"]
    rows = [["none (the start)", "-", "-", "-", "-", "-", before["correct"], before["helpful"], before["tpr"]]]
    rewards, routing = {}, {}
    for (label, _, _), arm in zip(ARMS, arms):
        after = arm.result["after"]
        values = {k: [v for _, v in logged(arm, k)] for k in ("logprob_diff/mean", "logprob_diff/max", "mismatch/k3_kl",
                                                             "mismatch/routing_disagreement", "reward/mean")}
        rows.append([label, mean(values["logprob_diff/mean"]), max(values["logprob_diff/max"]),
                     mean(values["mismatch/k3_kl"]), mean(values["mismatch/routing_disagreement"]),
                     mean(values["reward/mean"][-5:]), after["correct"], after["helpful"], after["tpr"]])
        steps = [s for s, _ in logged(arm, "reward/mean")]
        rewards[label] = (steps, values["reward/mean"], None)
        routing[label] = (steps, values["mismatch/routing_disagreement"], None)
    png = plot_panels(f"{args.output_dir}/{NAME}.png", "GRPO, bf16 rollouts, fp32 trainer", "step",
                      [("reward (mean over rollouts)", rewards), ("routing disagreement (share of tokens)", routing)])
    notes = f"""Every arm starts from `{start}` with the same seed and prompts, decodes its rollouts on a bf16 copy of the
policy (refreshed after each optimizer step) and trains the fp32 weights in fp32. |dlogp| and k3 KL compare the
sampled tokens' log-probs of the decoder with the trainer's at the start of each step (mean over the steps; max:
the largest of any step); routing disagreement is the share of tokens (prompt and completion) whose top-k experts
differ in at least one MoE layer between the bf16 decoder and the fp32 trainer's own router, averaged over the
steps: under R3 the trainer runs the decoder's experts anyway, the metric says what it would have picked. The
exact mode of issue 32 (item 5) is not built: no arm. Held-out rows: {before['prompts']} rooms x
{before['samples_per_prompt']} responses at τ {before['temperature']}.

""" + GRPO_SIZE_NOTE
    return write_report(args, TITLE, COLUMNS, rows, notes, ([rft_arm] if rft_arm else []) + arms, png, DECIMALS)
