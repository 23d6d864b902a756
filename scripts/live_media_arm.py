"""One arm of `python -m experiments live_media`, the multimodal one, on the experiment's sessions: the diagnosis runs
of experiments/results/live_media/README.md (each change to the thinker or the layout measured without re-training
the text-only arm, which those changes do not touch).

    PYTHONPATH=. python scripts/live_media_arm.py WORK_DIR TAG [--tiny] [--cue NAME]

prints the experiment's rows for the multimodal arm and writes WORK_DIR/result-TAG.json (rows and outcomes). --cue: what
a change's clip sounds like (one of experiments.live_media.CUES; default the experiment's, CUE); the sessions are
rewritten under WORK_DIR/data each run."""
import argparse
import json
import os

from experiments import live_media
from experiments.common import ExperimentArgs


def main(work: str, tag: str, tiny: bool, cue: str = live_media.CUE) -> dict:
    args = ExperimentArgs(name="live_media", tiny=tiny, work_dir=work, output_dir=os.path.join(work, "report-" + tag))
    size = live_media.TINY if tiny else live_media.FULL
    _, held, files = live_media.write_sessions(args, size, cue)
    thinker = live_media.make_thinker(args.model, os.path.join(work, "thinker-" + tag), args.seed)
    arm = live_media.run_live(args, "multimodal-" + tag, live_media.media_arm_flags(thinker, files, size))
    rows = live_media.mode_rows(arm.result, held)
    for row in rows:
        print(dict(zip(live_media.COLUMNS, row)), flush=True)
    out = {"command": arm.command, "columns": live_media.COLUMNS, "rows": rows,
           "cue": cue,
           "outcomes": {k: v["outcomes"] for k, v in arm.result["rows"].items()}}
    with open(os.path.join(work, f"result-{tag}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work_dir")
    p.add_argument("tag")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--cue", choices=sorted(live_media.CUES), default=live_media.CUE)
    a = p.parse_args()
    main(a.work_dir, a.tag, a.tiny, a.cue)
