"""How far the live_media thinker's frozen random audio tower sets a change's clip (each cue of
experiments.live_media.CUES) apart from the other clips, before any training: seconds per cue, to pick a cue by
before a full run.

    PYTHONPATH=. python scripts/audio_cue_separation.py WORK_DIR [--sessions 60] [--cues chime,tone_bed]

For each cue, the said clips of the experiment's first training sessions (a change: the cue and the announcement;
elsewhere: the interval's other host line or a stock phrase) are encoded, each clip's rows mean-pooled (all of them,
and the first second's alone), and the separation is the distance between the two classes' means over the
within-class spread (root mean square distance of a clip to its class's mean). It is taken where each part of the
tower that could train begins: the raw log-mel (the whole tower trainable), the layers' input (all but the
convolutions), the projector's input (ln_post: --train_projector) and the rows the language model gets (nothing)."""
import argparse
import os

import numpy as np

STAGES = ("log-mel", "layers' input", "projector's input", "rows out")


def separation(pooled: np.ndarray, is_change: np.ndarray) -> float:
    """Class-mean distance over the within-class root mean square spread of the rows of `pooled`."""
    a, b = pooled[is_change], pooled[~is_change]
    spread = np.sqrt(np.concatenate([((a - a.mean(0)) ** 2).sum(1), ((b - b.mean(0)) ** 2).sum(1)]).mean())
    return float(np.linalg.norm(a.mean(0) - b.mean(0)) / spread)


def stage_rows(thinker, features):
    """The clip's rows at each of STAGES (time along the first axis)."""
    import torch

    tower, seen = thinker.audio_tower, {}

    def keep(name):
        def hook(module, inputs):
            seen[name] = inputs[0]  # returns None: the module's inputs stay as they are
        return hook

    hooks = [tower.layers[0].register_forward_pre_hook(keep("layers")),
             tower.ln_post.register_forward_pre_hook(keep("post"))]
    try:
        with torch.no_grad():
            out = thinker.encode_audio(features).embeds
    finally:
        for h in hooks:
            h.remove()
    return [features.T, seen["layers"], seen["post"], out]


def main(argv=None) -> None:
    from experiments import live_media
    from experiments.common import ExperimentArgs
    from livemoe.engine import load_model
    from livemoe.engine.multimodal.decode import decode_wav
    from livemoe.train.live.omni import media_processor
    from livemoe.train.live.world import LiveWorldConfig, make_sessions

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work_dir")
    p.add_argument("--sessions", type=int, default=60)
    p.add_argument("--cues", default=",".join(live_media.CUES))
    args = p.parse_args(argv)
    exp = ExperimentArgs(name="live_media", work_dir=args.work_dir, output_dir=args.work_dir)
    thinker = load_model(live_media.make_thinker(exp.model, os.path.join(args.work_dir, "thinker"), exp.seed))
    processor = media_processor(thinker)
    cache = os.path.join(args.work_dir, "media")
    world = LiveWorldConfig(num_intervals=live_media.FULL["intervals"])
    sessions = make_sessions(args.sessions, exp.seed, world, "train")
    print(f"{'cue':18s} {'n change/other':>14s}  " + "  ".join(f"{s:>17s}" for s in STAGES) + "   (all rows; first second)")
    for cue in args.cues.split(","):
        pooled, is_change = [[] for _ in STAGES], []
        for s in sessions:
            for iv in live_media.cue_session(s, cache, "said", cue)["intervals"]:
                path = next(e["path"] for e in iv["events"] if e["type"] == "audio")
                with open(path, "rb") as f:
                    wave = decode_wav(f.read(), path, 16000, 60.0)
                item = processor.audio_waveform(wave, path)
                for k, rows in enumerate(stage_rows(thinker, item.data)):
                    rows = rows.float().numpy()
                    first = rows[: max(1, len(rows) // int(live_media.CLIP_SECONDS))]
                    pooled[k].append(np.concatenate([rows.mean(0), first.mean(0)]))
                is_change.append(bool(iv["changes"]))
        mask = np.array(is_change)
        cells = []
        for k in range(len(STAGES)):
            x = np.array(pooled[k])
            half = x.shape[1] // 2
            cells.append(f"{separation(x[:, :half], mask):7.1f}; {separation(x[:, half:], mask):7.1f}")
        print(f"{cue:18s} {int(mask.sum()):>6d}/{int((~mask).sum()):<7d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
