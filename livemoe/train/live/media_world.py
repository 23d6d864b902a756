"""The live world heard and seen, made offline: today's sessions (livemoe.train.live.world) with the host's lines
as speech and products as rendered frames, for a Qwen3-Omni-MoE thinker's live sessions (`audio` / `video` events,
livemoe.engine.live.media). The gold decisions are the text world's, unchanged.

- Speech: Debian's `espeak-ng` writes each host line to a WAV (22.05 kHz), resampled here to 16 kHz (band-limited,
  by FFT). espeak-ng is a system program, not a Python dependency: `apt-get install espeak-ng`; without it the
  heard world refuses to start, saying so. Cards need only PIL.
- Frames: a product card (its name, link number, price and stock, drawn with PIL), a still PNG: a `video` event of one
  frame, which the engine pads to one temporal patch.
- What the assistant must pick up: `mode` "both" speaks every host line and shows a card for each change; "said"
  makes a change only heard (no card for it); "shown" makes it only seen (its spoken announcement is dropped).
  Frame captions become cards of the product held up; comments, joins, gifts and room metadata stay text.

Everything rendered is cached under `cache_dir` by a hash of what it shows or says, so regenerating a world (or
another mode of it) renders nothing twice. The sessions reference the files by path (the JSONL stays small):

    python -m livemoe.train.live.media_world --sessions 8 --seed 0 --mode said --out heard.jsonl --cache media/
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import wave

import numpy as np

SAMPLE_RATE = 16000
MODES = ("both", "said", "shown")
CARD_SIZE = (256, 160)


def speak(text: str, cache_dir: str) -> str:
    """The path of a 16 kHz mono WAV of `text` spoken by espeak-ng (made once, then cached)."""
    path = os.path.join(cache_dir, "speech-" + hashlib.sha256(text.encode()).hexdigest()[:20] + ".wav")
    if os.path.exists(path):
        return path
    binary = shutil.which("espeak-ng")
    if binary is None:
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng): the heard world speaks the "
                           "host's lines with it")
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "speech.wav")
        subprocess.run([binary, "-w", raw, "--", text], check=True, capture_output=True, timeout=60)
        with wave.open(raw) as w:
            rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    write_wav(path, resample(pcm.astype(np.float32) / 32768, rate, SAMPLE_RATE))
    return path


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling by FFT (the spectrum cut or padded at the lower Nyquist frequency)."""
    if rate == target:
        return x
    n = max(1, round(len(x) * target / rate))
    spectrum = np.fft.rfft(x)
    keep = min(len(spectrum), n // 2 + 1)
    out = np.fft.irfft(spectrum[:keep], n) * (n / len(x))
    return out.astype(np.float32)


def write_wav(path: str, x: np.ndarray) -> None:
    tmp = path + ".tmp"
    with wave.open(tmp, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    os.replace(tmp, path)  # whole or not at all: another generator may read the cache


def card(product: dict, cache_dir: str, banner: str | None = None) -> str:
    """The path of a PNG of the product's card; banner: a line in white on a red bar across its top."""
    from PIL import Image, ImageDraw

    a = product["attributes"]
    lines = [f"link {product['link']}", product["name"], f"price: {a.get('price', '?')}", f"stock: {a.get('stock', '?')}"]
    key = "\n".join(lines + ([f"banner: {banner}"] if banner else []))
    path = os.path.join(cache_dir, "card-" + hashlib.sha256(key.encode()).hexdigest()[:20] + ".png")
    if os.path.exists(path):
        return path
    image = Image.new("RGB", CARD_SIZE, (250, 250, 245))
    draw = ImageDraw.Draw(image)
    draw.rectangle([4, 4, CARD_SIZE[0] - 5, CARD_SIZE[1] - 5], outline=(200, 40, 40), width=3)
    if banner:
        draw.rectangle([0, 0, CARD_SIZE[0], 36], fill=(210, 30, 30))
        draw.text((16, 12), banner, fill=(255, 255, 255))
        lines = lines[:3]  # the bar covers the first line's place
    for k, line in enumerate(lines):
        draw.text((16, (48 if banner else 16) + 32 * k), line, fill=(20, 20, 20))
    tmp = path + ".tmp"
    image.save(tmp, "PNG")
    os.replace(tmp, path)
    return path


def media_session(session: dict, cache_dir: str, mode: str = "both") -> dict:
    """A world session with its host lines as `audio` events and its products as `video` events (see the module
    doc); intervals keep their decisions, facts and changes."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    os.makedirs(cache_dir, exist_ok=True)
    products = {p["link"]: {**p, "attributes": dict(p["attributes"])} for p in session["products"]}
    by_name = {p["name"]: link for link, p in products.items()}
    intervals = []
    for interval in session["intervals"]:
        changed = {c["link"] for c in interval["changes"]}
        for c in interval["changes"]:
            products[c["link"]]["attributes"][c["attribute"]] = c["value"]
        events = []
        for e in interval["events"]:
            if e["type"] == "transcript":
                announces = e["text"].startswith("news! ")
                if announces and mode == "shown":
                    continue  # the change is only seen
                events.append({"type": "audio", "path": speak(e["text"], cache_dir)})
            elif e["type"] == "frame":
                held = next((link for name, link in by_name.items() if name in e["text"]), None)
                if held is None:
                    events.append(e)
                else:
                    events.append({"type": "video", "path": card(products[held], cache_dir)})
            else:
                events.append(e)
        if mode != "said":
            events += [{"type": "video", "path": card(products[link], cache_dir)} for link in sorted(changed)]
        intervals.append({**interval, "events": events})
    return {**session, "id": f"{session['id']}-{mode}", "intervals": intervals, "media_mode": mode}


def main(argv: list[str] | None = None) -> None:
    from livemoe.train.live.world import make_sessions

    p = argparse.ArgumentParser(prog="python -m livemoe.train.live.media_world", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=MODES, default="both")
    p.add_argument("--out", required=True, help="JSONL of sessions (media by path)")
    p.add_argument("--cache", required=True, help="where rendered speech and cards are kept")
    args = p.parse_args(argv)
    with open(args.out, "w") as f:
        for s in make_sessions(args.sessions, args.seed):
            f.write(json.dumps(media_session(s, args.cache, args.mode)) + "\n")


if __name__ == "__main__":
    main()
