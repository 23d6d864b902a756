"""One arm of `python -m experiments live_media`, the multimodal one, on the experiment's sessions: the diagnosis runs
of experiments/results/live_media/README.md (each change to the thinker or the layout measured without re-training
the text-only arm, which those changes do not touch).

    python scripts/live_media_arm.py WORK_DIR TAG [--tiny]

prints the experiment's rows for the multimodal arm and writes WORK_DIR/result-TAG.json (rows and outcomes)."""
import json
import os
import sys

from experiments import live_media
from experiments.common import ExperimentArgs
from livemoe.train.live.data import save_sessions
from livemoe.train.live.world import LiveWorldConfig, make_sessions


def main(work: str, tag: str, tiny: bool) -> dict:
    args = ExperimentArgs(name="live_media", tiny=tiny, work_dir=work, output_dir=os.path.join(work, "report-" + tag))
    size = live_media.TINY if tiny else live_media.FULL
    data, cache = os.path.join(work, "data"), os.path.join(work, "media")
    os.makedirs(data, exist_ok=True)
    world = LiveWorldConfig(num_intervals=size["intervals"])
    train = [live_media.cue_session(s, cache, "said" if i % 2 == 0 else "shown")
             for i, s in enumerate(make_sessions(size["train"], args.seed, world, "train"))]
    held_base = make_sessions(size["eval"], args.seed + 10_000, world, "heldout")
    held = [live_media.cue_session(s, cache, mode) for mode in ("said", "shown") for s in held_base]
    files = {name: os.path.join(data, name + ".jsonl") for name in ("train_media", "heldout_media")}
    save_sessions(train, files["train_media"])
    save_sessions(held, files["heldout_media"])
    thinker = live_media.make_thinker(args.model, os.path.join(work, "thinker-" + tag), args.seed)
    arm = live_media.run_live(args, "multimodal-" + tag, [
        "--model", thinker, "--data", files["train_media"], "--eval_data", files["heldout_media"],
        "--train_projector", "--stage", "sft", "--sft_steps", str(size["steps"]), "--max_len", "2048"])
    modes = [s["media_mode"] for s in held for _ in s["intervals"]]
    change = [bool(iv["changes"]) for s in held for iv in s["intervals"]]
    gold_ans = live_media.held_gold_ans(held)
    rows = {}
    for stage, r in arm.result["rows"].items():
        o = r["outcomes"]
        for mode in ("said", "shown"):
            ans = [m == mode for m, a in zip(modes, gold_ans) if a]
            rows[f"{stage}, {mode} only"] = {
                "state acc at changes": live_media.rate(o["state"], [m == mode and c for m, c in zip(modes, change)]),
                "state acc elsewhere": live_media.rate(o["state"], [m == mode and not c for m, c in zip(modes, change)]),
                "recipient acc": live_media.rate(o["recipient"], ans), "task acc": live_media.rate(o["task"], ans)}
            print(stage, mode, rows[f"{stage}, {mode} only"], flush=True)
    out = {"command": arm.command, "rows": rows, "outcomes": {k: v["outcomes"] for k, v in arm.result["rows"].items()}}
    with open(os.path.join(work, f"result-{tag}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--tiny" in sys.argv[3:])
