"""`python -m experiments [NAME]` (or `python -m train.experiments [NAME]`) from a checkout: the LiveThinking seed's
ablations at toy scale, one command each. Research beside the product, not installed with it: it drives the
installed trainers as a user would.

Each experiment is a module here with NAME, TITLE (a line for the listing) and run(args) -> the report's
path; an arm of an experiment is a run of `livemoe.train.rft` or `livemoe.train.grpo` through the trainer's own config
and entry point (experiments/common.py). The report goes to experiments/results/NAME/ (README.md with the
table, command, date and machine; results.json; a PNG where the seed has a figure). experiments/results/ also
holds the LiveAssistant seed's results (live/: `python -m train.live` runs, and gspo_one_session.py's check) and
live_media's (issue 36: a text-only against a multimodal live policy, each arm a `python -m train.live` run).
"""
from experiments import length_sweep, live_media, moe_vs_dense, reward_ablation, rft_vs_sft, rollout_mismatch
from experiments.common import ExperimentArgs, ExperimentError

EXPERIMENTS = {m.NAME: m for m in (rft_vs_sft, length_sweep, reward_ablation, moe_vs_dense, rollout_mismatch, live_media)}


def get(name: str):
    """The experiment's module; a bad name is an ExperimentError that lists the names."""
    if name not in EXPERIMENTS:
        raise ExperimentError(f"no experiment named {name!r}; the experiments are: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


def listing() -> str:
    width = max(map(len, EXPERIMENTS))
    return "\n".join(f"  {name:<{width}}  {m.TITLE}" for name, m in EXPERIMENTS.items())


def run(args: ExperimentArgs) -> str:
    return get(args.name).run(args)
