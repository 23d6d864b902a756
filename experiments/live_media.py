"""Issue 36's table: a text-only and a multimodal live policy on the same held-out sessions, where a price or stock
change arrives only *said* (audio) or only *shown* (a video frame).

The world: livemoe.train.live.world's sessions and gold decisions (MEM at each announced change), heard and seen
through livemoe.train.live.media_world's renderers, with every interval given exactly one medium of one shape, so the
text lines a session writes for its media ("audio: 4.0 s", "video: 2 frames") say nothing:
  said   each interval has one 4.0 s clip (padded or cut): at a change, the host's spoken announcement over a hiss
         (CUE, white noise about 6 dB over the speech); elsewhere the host's other line of the interval, or a stock
         phrase, spoken;
  shown  each interval has one product card: at a change, the changed product's card under a red "NEW PRICE" /
         "SOLD OUT" banner; elsewhere a plain card of the product held up (or of a product drawn at random).
The announcement's text ("news! ...") is in neither; every other event stays text. What the multimodal policy can
pick up is that the hiss was heard or a banner seen: cues chosen so that a tiny encoder and projector could learn
them in minutes (docs/multimodal.md says how each was chosen and measured). It cannot
read the new price off the card or hear it in the speech (the MEM note's content): the table's claim is the
decision to write the note at the change, not what the note says.

Arms, each an MA-MSFT run of `python -m train.live` on the same sessions (half said, half shown) and the same
held-out sessions (each both ways), greedy through a LiveSession:
  text-only   the committed student, the sessions' audio and video removed (a text checkpoint refuses them);
  multimodal  a tiny Qwen3-Omni-MoE thinker: random audio and vision encoders made by transformers (frozen; the
              audio tower's convolutions re-drawn with Kaiming's init, both encoders' output rows scaled to a
              token embedding's norm, see make_thinker) beside the student's
              language model (the same weights as the text arm's start; the seven media tokens' rows new), its
              projectors trained (--train_projector).
"""
import json
import os
import shutil

import numpy as np

from experiments.common import Arm, ExperimentArgs, announce, write_report

NAME = "live_media"
TITLE = "LiveAssistant heard and seen: text-only vs multimodal policy where a change is only said or only shown"
USES_START = False
COLUMNS = ["policy", "held-out", "state acc at changes", "n", "state acc elsewhere", "n ", "recipient acc", "task acc"]

TINY = {"train": 4, "eval": 2, "intervals": 3, "steps": 2}
FULL = {"train": 192, "eval": 32, "intervals": 6, "steps": 400}
CLIP_SECONDS = 4.0
FILLERS = ["thanks for watching everyone.", "remember to follow the stream.", "we have more coming up soon.",
           "say hello in the chat."]
MEDIA_SPECIALS = ["<|audio_pad|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|audio_end|>",
                  "<|vision_start|>", "<|vision_end|>"]  # the thinker's placeholder and marker tokens, in its order


# ------------------------------------------------------------------------------------------ the thinker
def make_thinker(student: str, path: str, seed: int) -> str:
    """A Qwen3-Omni-MoE thinker checkpoint: transformers' own random init of tiny audio and vision encoders (the audio
    tower's convolutions re-drawn, both encoders' output rows scaled to a token embedding's norm: the note below), the
    student's language model (its shape and weights) and tokenizer with the media tokens added."""
    import torch
    from transformers import (AutoTokenizer, Qwen3OmniMoeThinkerConfig,
                              Qwen3OmniMoeThinkerForConditionalGeneration)

    from livemoe.engine import load_model, save_model

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    with open(os.path.join(student, "config.json")) as f:
        raw = json.load(f)
    tok = AutoTokenizer.from_pretrained(student)
    tok.add_special_tokens({"additional_special_tokens": MEDIA_SPECIALS})
    ids = [tok.convert_tokens_to_ids(t) for t in MEDIA_SPECIALS]
    assert ids == list(range(ids[0], ids[0] + 7)), ids
    hidden, head_dim = raw["hidden_size"], raw["head_dim"]
    third = head_dim // 2 // 3  # the rotary frequencies given to time / height / width
    text = {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts_per_tok",
                                "rms_norm_eps", "norm_topk_prob", "eos_token_id")}
    text.update(num_experts=raw["num_local_experts"], vocab_size=max(raw["vocab_size"], len(tok)),
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": raw["rope_parameters"]["rope_theta"],
                                 "mrope_section": [head_dim // 2 - 2 * third, third, third], "mrope_interleaved": True})
    config = Qwen3OmniMoeThinkerConfig(
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, max_source_positions=1500, n_window=50, output_dim=hidden, n_window_infer=400,
                          conv_chunksize=50, downsample_hidden_size=16),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                           num_position_embeddings=256, deepstack_visual_indexes=[0]),
        text_config=text, audio_token_id=ids[0], image_token_id=ids[1], video_token_id=ids[2],
        audio_start_token_id=ids[3], vision_start_token_id=ids[5], position_id_per_seconds=25)
    torch.manual_seed(seed)
    hf = Qwen3OmniMoeThinkerForConditionalGeneration._from_config(config)
    with torch.no_grad():  # see the note above the world's functions
        for name in ("conv2d1", "conv2d2", "conv2d3", "conv_out"):
            torch.nn.init.kaiming_normal_(getattr(hf.model.audio_tower, name).weight,
                                          nonlinearity="linear" if name == "conv_out" else "relu")
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    thinker, lm = load_model(path), load_model(student)
    state, source = thinker.state_dict(), lm.state_dict()
    with torch.no_grad():
        for name, value in source.items():
            rows = min(value.shape[0], state[name].shape[0])
            state[name][:rows].copy_(value[:rows])  # embed / lm_head: the media tokens' rows stay transformers' init
        match_media_scale(thinker, state)
    save_model(thinker, path, tokenizer=tok)
    return path


def match_media_scale(thinker, state: dict) -> dict:
    """Scales the audio tower's and the vision merger's last projections (in `state`) so that their rows have the
    token embeddings' mean norm; -> the factors. Measured on a chime over noise and two frames of noise."""
    import torch

    from livemoe.train.live.omni import media_processor

    rng = np.random.default_rng(0)
    processor = media_processor(thinker)
    wave = chime(4.0) + rng.normal(0, 0.05, 64000).astype(np.float32)
    frames = [rng.integers(0, 256, (256, 320, 3), dtype=np.uint8) for _ in range(2)]
    audio, video = processor.audio_waveform(wave, "calibration"), processor.video_frames(frames, "calibration")
    factors = {}
    with torch.no_grad():
        target = state["model.embed_tokens.weight"].norm(dim=-1).mean()
        for name, rows in (("audio_tower.proj2", thinker.encode_audio(audio.data).embeds),
                           ("visual.merger.mlp.2", thinker.encode_vision(video.data, video.grid_thw).embeds)):
            factors[name] = float(target / rows.norm(dim=-1).mean())
            state[name + ".weight"].mul_(factors[name])
            state[name + ".bias"].mul_(factors[name])
    return factors


# Why make_thinker re-draws the audio tower's convolutions: with transformers' init (std 0.02, zero biases) three 3x3
# convolutions and the output projection shrink the log-mel input by orders of magnitude, and the sinusoidal position
# table added after them is all that is left: the tower's rows do not depend on the clip, and nothing after it can
# hear (docs/multimodal.md has the measurement). Kaiming's fan-in init keeps the input's scale, as a trained encoder
# passes its input on; the vision encoder's patch embedding (fan-in 1536) already does.
# Why match_media_scale: the random encoders' output rows come out far smaller than a token's embedding, and media
# rows that small in context cost the policy its in-context copy of a viewer's name (docs/multimodal.md, measured).


# ------------------------------------------------------------------------------------------ the world
def chime(seconds: float = 1.0, rate: int = 16000) -> np.ndarray:
    """Two decaying tones (880 and 1320 Hz): the sound a stream plays over a price announcement."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.exp(-4 * t) * (np.sin(2 * np.pi * 880 * t) + np.sin(2 * np.pi * 1320 * t))).astype(np.float32)


def tone(seconds: float, hz: float, amplitude: float, rate: int = 16000) -> np.ndarray:
    """A steady sine."""
    return (amplitude * np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def under(speech: np.ndarray, bed: np.ndarray) -> np.ndarray:
    """The speech with `bed` playing under it from the clip's start (the bed's length: the clip's)."""
    n = int(CLIP_SECONDS * 16000)
    x = np.pad(speech[:n], (0, max(0, n - len(speech))))
    return x + np.resize(bed, n)


# What a change's clip sounds like, by name (`clip`'s `cue`): the speech of the announcement -> the clip's waveform.
# The audio tower cuts a clip into 1 s chunks, each convolved on its own with positions restarting, so a cue heard
# in every second reaches all of the clip's rows, one before the speech only the first second's.
CUES = {
    "chime": lambda speech: np.concatenate([chime(), speech]),
    "loud_chime": lambda speech: np.concatenate([np.clip(2.5 * chime(), -1, 1), speech]),
    "double_chime": lambda speech: np.concatenate([chime(), chime(), speech]),
    "beep": lambda speech: np.concatenate([tone(1.0, 2000, 0.5), speech]),
    "spoken_twice": lambda speech: np.concatenate([chime(), speech, speech]),
    "chime_each_second": lambda speech: under(speech, chime()),
    "tone_bed": lambda speech: under(speech, tone(1.0, 2000, 0.2)),
    "hiss": lambda speech: under(speech, hiss()),
}
CUE = "hiss"  # the experiment's: scripts/audio_cue_separation.py measured how far each sets a change's clip apart


def hiss(amplitude: float = 0.2, rate: int = 16000) -> np.ndarray:
    """CLIP_SECONDS of white noise (the same every time): a crowd's hiss under an announcement, about 6 dB over the
    speech."""
    return np.random.default_rng(0).normal(0, amplitude, int(CLIP_SECONDS * rate)).astype(np.float32)


def clip(text: str, cache_dir: str, cue: str | None) -> str:
    """A CLIP_SECONDS WAV of `text` spoken (with the named cue of CUES, or plain for None), padded with silence or
    cut (cached)."""
    import hashlib

    from livemoe.engine.multimodal.decode import decode_wav
    from livemoe.train.live.media_world import SAMPLE_RATE, speak, write_wav

    if cue is not None and cue not in CUES:
        raise ValueError(f"cue {cue!r}: not one of {sorted(CUES)}")
    key = "True" if cue == "chime" else cue or "False"  # the committed run's cache keys (with_chime) stay valid
    path = os.path.join(cache_dir, "clip-" + hashlib.sha256(f"{key}|{text}".encode()).hexdigest()[:20] + ".wav")
    if not os.path.exists(path):
        with open(speak(text, cache_dir), "rb") as f:
            speech = decode_wav(f.read(), text, SAMPLE_RATE, 60.0)
        x = CUES[cue](speech) if cue else speech
        n = int(CLIP_SECONDS * SAMPLE_RATE)
        write_wav(path, np.pad(x[:n], (0, max(0, n - len(x)))))
    return path


def cue_session(session: dict, cache_dir: str, mode: str, cue: str = CUE) -> dict:
    """The session heard ("said", a change's clip with the named cue of CUES) or seen ("shown") as the module doc
    says; decisions, facts and changes kept."""
    import random

    from livemoe.train.live.media_world import card

    os.makedirs(cache_dir, exist_ok=True)
    rng = random.Random(f"{session['id']}/{mode}")
    products = {p["link"]: {**p, "attributes": dict(p["attributes"])} for p in session["products"]}
    intervals = []
    for iv in session["intervals"]:
        for c in iv["changes"]:
            products[c["link"]]["attributes"][c["attribute"]] = c["value"]
        news = [e for e in iv["events"] if e["type"] == "transcript" and e["text"].startswith("news! ")]
        events = [e for e in iv["events"] if e not in news]
        if mode == "said":
            other = [e["text"] for e in events if e["type"] == "transcript"]
            line = news[0]["text"] if news else (other[0] if other else rng.choice(FILLERS))
            events.append({"type": "audio", "path": clip(line, cache_dir, cue if news else None)})
        else:
            if iv["changes"]:
                change = iv["changes"][0]
                banner = "SOLD OUT" if change["attribute"] == "stock" else "NEW PRICE"
                events.append({"type": "video", "path": card(products[change["link"]], cache_dir, banner)})
            else:
                held = [p for p in products.values() for e in events
                        if e["type"] == "frame" and p["name"] in e["text"]]
                product = held[0] if held else products[rng.choice(sorted(products))]
                events.append({"type": "video", "path": card(product, cache_dir)})
        intervals.append({**iv, "events": events})
    return {**session, "id": f"{session['id']}-{mode}", "intervals": intervals, "media_mode": mode}


def text_only(session: dict) -> dict:
    """The session as a text checkpoint takes it: its audio and video events removed."""
    from livemoe.engine.live.media import is_media_event

    return {**session, "intervals": [{**iv, "events": [e for e in iv["events"] if not is_media_event(e)]}
                                     for iv in session["intervals"]]}


# ------------------------------------------------------------------------------------------ the run
def run_live(args: ExperimentArgs, arm: str, flags: list) -> Arm:
    """livemoe.train.live's own run() on the config its parser makes of the flags."""
    import shlex

    from livemoe.train.config import parse_config
    from livemoe.train.live.config import LiveConfig
    from livemoe.train.live.trainer import run

    argv = [*flags, "--output_dir", os.path.join(args.work_dir, arm), "--seed", str(args.seed),
            "--progress", str(args.progress).lower()]
    cfg = parse_config(LiveConfig, argv, prog="python -m train.live")
    command = "python -m train.live " + shlex.join(argv)
    announce(args, arm, command)
    return Arm(name=arm, command=command, output_dir=cfg.output_dir, result=run(cfg))


def rate(outcomes: list, mask: list) -> tuple:
    """(accuracy %, n) of the outcomes where mask holds ("-" for none)."""
    xs = [o for o, m in zip(outcomes, mask) if m]
    return (100.0 * sum(xs) / len(xs) if xs else "-"), len(xs)


def write_sessions(args: ExperimentArgs, size: dict, cue: str = CUE) -> tuple[list, list, dict]:
    """The training and held-out sessions (the held-out ones said, then the same shown), rendered and saved:
    -> (training sessions, held-out sessions, {train_media, heldout_media, train_text, heldout_text: JSONL path})."""
    from livemoe.train.live.data import save_sessions
    from livemoe.train.live.world import LiveWorldConfig, make_sessions

    data = os.path.join(args.work_dir, "data")
    cache = os.path.join(args.work_dir, "media")
    os.makedirs(data, exist_ok=True)
    world = LiveWorldConfig(num_intervals=size["intervals"])
    train = [cue_session(s, cache, "said" if i % 2 == 0 else "shown", cue)
             for i, s in enumerate(make_sessions(size["train"], args.seed, world, "train"))]
    held_base = make_sessions(size["eval"], args.seed + 10_000, world, "heldout")
    held = [cue_session(s, cache, mode, cue) for mode in ("said", "shown") for s in held_base]
    files = {}
    for name, sessions in (("train_media", train), ("heldout_media", held), ("train_text", list(map(text_only, train))),
                           ("heldout_text", list(map(text_only, held)))):
        files[name] = os.path.join(data, name + ".jsonl")
        save_sessions(sessions, files[name])
    return train, held, files


def media_arm_flags(thinker: str, files: dict, size: dict) -> list:
    return ["--model", thinker, "--data", files["train_media"], "--eval_data", files["heldout_media"],
            "--train_projector", *shared_flags(size)]


def shared_flags(size: dict) -> list:
    return ["--stage", "sft", "--sft_steps", str(size["steps"]), "--max_len", "2048"]


def mode_rows(result: dict, held: list) -> list:
    """Per stage and mode of an arm's result: [stage, "<mode> only", state acc at changes, n, elsewhere, n,
    recipient acc, task acc]."""
    # per held-out interval (the said sessions, then the same sessions shown): the mode, and whether a change is in it
    modes = [s["media_mode"] for s in held for _ in s["intervals"]]
    change = [bool(iv["changes"]) for s in held for iv in s["intervals"]]
    rows = []
    for stage, r in result["rows"].items():
        o = r["outcomes"]
        for mode in ("said", "shown"):
            at, n_at = rate(o["state"], [m == mode and c for m, c in zip(modes, change)])
            off, n_off = rate(o["state"], [m == mode and not c for m, c in zip(modes, change)])
            ans = [m == mode for m, s in zip(modes, held_gold_ans(held)) if s]
            rows.append([stage, f"{mode} only", at, n_at, off, n_off, rate(o["recipient"], ans)[0],
                         rate(o["task"], ans)[0]])
    return rows


def run(args: ExperimentArgs) -> str:
    from livemoe.train.live.judge import paired_margin

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("live_media speaks the host's lines with espeak-ng, which is not installed "
                           "(apt-get install espeak-ng)")
    size = TINY if args.tiny else FULL
    train, held, files = write_sessions(args, size)
    thinker = make_thinker(args.model, os.path.join(args.work_dir, "thinker"), args.seed)
    media_arm = run_live(args, "multimodal", media_arm_flags(thinker, files, size))
    text_arm = run_live(args, "text_only", ["--model", args.model, "--data", files["train_text"],
                                            "--eval_data", files["heldout_text"], *shared_flags(size)])
    modes = [s["media_mode"] for s in held for _ in s["intervals"]]
    change = [bool(iv["changes"]) for s in held for iv in s["intervals"]]
    rows, margins = [], {}
    for arm_name, arm in (("text-only (student)", text_arm), ("multimodal (thinker)", media_arm)):
        rows += [[f"{arm_name}, {r[0]}", *r[1:]] for r in mode_rows(arm.result, held)]
    for mode in ("said", "shown"):
        mask = [m == mode and c for m, c in zip(modes, change)]
        a = [x for x, m in zip(text_arm.result["rows"]["MA-MSFT"]["outcomes"]["state"], mask) if m]
        b = [x for x, m in zip(media_arm.result["rows"]["MA-MSFT"]["outcomes"]["state"], mask) if m]
        margins[mode] = paired_margin(a, b) if a else (0.0, 0.0)
    notes = NOTES.format(doc=__doc__.split("\n\n", 1)[1].strip(), train=len(train), eval=len(held) // 2,
                         intervals=size["intervals"], steps=size["steps"], **{
                             f"{m}_{k}": v for m, (d, se) in margins.items() for k, v in (("d", d), ("se", se))})
    return write_report(args, TITLE, COLUMNS, rows, notes, [text_arm, media_arm],
                        decimals={"n": 0, "n ": 0})


def held_gold_ans(held: list) -> list:
    """Per held-out interval whether its gold decision is an ANS (the intervals recipient and task are scored on)."""
    return [iv["decision"]["kind"] == "ANS" for s in held for iv in s["intervals"]]


NOTES = """{doc}

Sizes: {train} training sessions of {intervals} intervals (half said, half shown), MA-MSFT {steps} steps (batch 4,
the live defaults otherwise) per arm; {eval} held-out sessions, each played said and shown. "State acc at changes":
the intervals whose gold decision is the MEM of an announced change (the fact arrives only by the medium); "elsewhere":
every other interval (comments, questions, gifts, joins: text for both arms). Multimodal minus text-only at the
changes, paired on the same intervals: said {said_d:+.1f} ± {said_se:.1f}, shown {shown_d:+.1f} ± {shown_se:.1f}
(% points ± standard error). Recipient and task accuracy are over the gold-ANS intervals of each mode."""
