"""The seed's Figure 4: GRPO from one RFT student across length-reward targets (the band [λ_lower, λ_upper]
x L_ref that the length reward pays for), with correctness, helpfulness and TPR against the length ratio
reached (held-out TPR after GRPO / the RFT student's)."""
from experiments.common import (FULL_GRPO, FULL_RFT_START, GRPO_SIZE_NOTE, TINY_GRPO, TINY_RFT, ExperimentArgs,
                                plot_panels, rft_start, run_grpo, write_report)

NAME = "length_sweep"
TITLE = "Figure 4: GRPO across length-reward targets (λ_lower, λ_upper): quality and TPR against the length ratio"
USES_START = True
# (λ_lower, λ_upper): from a strong brevity constraint to almost none; the seed's own is (0.4, 0.5)
BANDS = [(0.2, 0.3), (0.4, 0.5), (0.6, 0.7), (0.8, 0.9)]
TINY_BANDS = BANDS[:2]
COLUMNS = ["λ_lower", "λ_upper", "Length ratio", "Correct.", "Helpful.", "TPR"]
DECIMALS = {"λ_lower": 2, "λ_upper": 2, "Length ratio": 2}


def run(args: ExperimentArgs) -> str:
    start, rft_arm = rft_start(args, TINY_RFT if args.tiny else FULL_RFT_START)
    bands = TINY_BANDS if args.tiny else BANDS
    shared = {}
    arms = [run_grpo(args, f"lambda_{lower}_{upper}", start, TINY_GRPO if args.tiny else FULL_GRPO,
                     ["--lambda_lower", lower, "--lambda_upper", upper], shared) for lower, upper in bands]
    before = arms[0].result["before"]
    rows = [["-", "-", 1.0, before["correct"], before["helpful"], before["tpr"]]]
    for (lower, upper), arm in zip(bands, arms):
        after = arm.result["after"]
        rows.append([lower, upper, ratio(after["tpr"], before["tpr"]), after["correct"], after["helpful"], after["tpr"]])
    sweep = sorted(rows[1:], key=lambda r: r[2])  # drawn in the order of the ratio reached
    xs = [r[2] for r in sweep]
    names = [f"[{r[0]}, {r[1]}]" for r in sweep]
    panels = [(ylabel, {"GRPO": (xs, [r[i] for r in sweep], names), "the RFT student": ([1.0], [rows[0][i]], None)})
              for ylabel, i in (("correctness (%)", 3), ("helpfulness (%)", 4), ("TPR (tokens)", 5))]
    png = plot_panels(f"{args.output_dir}/{NAME}.png", "GRPO across length-reward targets (point: [λ_lower, λ_upper])",
                      "length ratio (held-out TPR / the RFT student's)", panels)
    notes = f"""Every arm starts from `{start}` with the same seed and prompts and differs only in the length band;
the first row is that RFT student. The length ratio is what the arm reached on the held-out rooms (its TPR over
the RFT student's), not the target: the reward pays for [λ_lower, λ_upper] x L_ref, L_ref being the RFT student's
own mean sampled length per training prompt. Rewards 0.4 correct + 0.3 helpful + 0.3 length, as the seed.
Held-out rows: {before['prompts']} rooms x {before['samples_per_prompt']} responses at τ {before['temperature']}.
The seed finds quality peaking at an intermediate ratio (its choice: [0.4, 0.5]); with a student that is
rarely correct, correctness carries little signal here and the sweep mostly shows the length reward at work.

""" + GRPO_SIZE_NOTE
    return write_report(args, TITLE, COLUMNS, rows, notes, ([rft_arm] if rft_arm else []) + arms, png,
                        DECIMALS)


def ratio(tpr: float, ref: float) -> float:
    return tpr / ref if ref else float("nan")
