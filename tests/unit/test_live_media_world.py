"""The live world heard and seen: host lines as espeak-ng speech (16 kHz WAV), products as PIL-rendered cards, the
text world's gold decisions unchanged, a change only said or only shown by mode, everything rendered cached; and a
heard-and-seen session played by a live session on a tiny Omni thinker."""
import os
import shutil
import wave

import numpy as np
import pytest

from livemoe.engine.multimodal.decode import decode_video
from livemoe.train.live.media_world import card, media_session, resample, speak
from livemoe.train.live.world import make_sessions

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                  reason="espeak-ng is not installed (apt-get install espeak-ng)")


def test_resample_keeps_a_tone():
    t = np.arange(22050) / 22050
    x = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    y = resample(x, 22050, 16000)
    assert len(y) == 16000
    ref = np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert np.abs(y[100:-100] - ref[100:-100]).max() < 1e-3


def test_cards_show_the_product_and_are_cached(tmp_path):
    from PIL import Image

    product = {"link": 7, "name": "clear case", "category": "x", "attributes": {"price": "19 yuan", "stock": "in stock"}}
    path = card(product, str(tmp_path))
    assert card(product, str(tmp_path)) == path and len(os.listdir(tmp_path)) == 1
    im = Image.open(path)
    frames = decode_video(open(path, "rb").read(), "card", fps=2.0, max_frames=8)
    assert im.size == (256, 160) and len(frames) == 1  # a still: one frame (the engine pads a temporal patch)
    changed = card({**product, "attributes": {"price": "29 yuan", "stock": "in stock"}}, str(tmp_path))
    assert changed != path
    assert np.abs(np.asarray(Image.open(changed).convert("L"), np.int16)
                  - np.asarray(im.convert("L"), np.int16)).sum() > 0  # the new price is drawn


@needs_espeak
def test_speech_is_16khz_and_cached(tmp_path):
    path = speak("link 3 is now 29 yuan.", str(tmp_path))
    mtime = os.path.getmtime(path)
    assert speak("link 3 is now 29 yuan.", str(tmp_path)) == path and os.path.getmtime(path) == mtime
    with wave.open(path) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert 0.5 < len(x) / 16000 < 10 and np.abs(x).max() > 1000  # speech, not silence


@needs_espeak
@pytest.mark.parametrize("mode", ["both", "said", "shown"])
def test_modes_keep_the_decisions(tmp_path, mode):
    session = next(s for s in make_sessions(8, seed=3) if any(i["changes"] for i in s["intervals"]))
    heard = media_session(session, str(tmp_path), mode)
    assert [i["decision"] for i in heard["intervals"]] == [i["decision"] for i in session["intervals"]]
    for before, after in zip(session["intervals"], heard["intervals"]):
        kinds = [e["type"] for e in after["events"]]
        assert "transcript" not in kinds
        announced = sum(e["type"] == "transcript" and e["text"].startswith("news! ") for e in before["events"])
        spoken = sum(e["type"] == "transcript" for e in before["events"])
        held = sum(e["type"] == "frame" for e in before["events"])
        assert kinds.count("audio") == spoken - (announced if mode == "shown" else 0)
        assert kinds.count("video") == held + (len(before["changes"]) if mode != "said" else 0)


@needs_espeak
def test_a_heard_and_seen_session_plays(tmp_path):
    from livemoe import LLM
    from livemoe.engine.live.session import LiveSession
    from tiny_omni import make_omni_checkpoint
    from tiny_tokenizer import train_tokenizer

    path = make_omni_checkpoint(tmp_path / "m", seed=1, tokenizer=train_tokenizer())[0]
    llm = LLM(path, device="cpu", num_kv_blocks=512, block_size=16, max_model_len=4096)
    heard = media_session(make_sessions(1, seed=0)[0], str(tmp_path / "media"), "both")
    s = LiveSession(llm, "you are the live assistant.", max_context=4000)
    media = 0
    for interval in heard["intervals"][:6]:
        d = s.step(interval["events"], interval["t"])
        media += sum(e["type"] in ("audio", "video") for e in interval["events"])
        assert d.kind in ("OBS", "MEM", "ANS")
    assert media > 0 and llm.core.stats()["encoder_cache_misses"] >= 1
