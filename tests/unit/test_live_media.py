"""Live sessions with `audio` and `video` events on a tiny Qwen3-Omni-MoE thinker: 20 intervals in which each step
prefills only its own events (its media encoded alone, the earlier intervals' media taken from the pinned cache),
compactions that keep the text and MEM notes and drop the media, and bad media refused naming the event."""
import base64

import numpy as np
import pytest

from livemoe import LLM
from livemoe.engine.errors import MediaError, RequestError
from livemoe.engine.live.session import LiveSession
from test_omni_engine import image_url, wav_b64
from tiny_omni import make_omni_checkpoint
from tiny_tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_omni_checkpoint(tmp_path_factory.mktemp("live_omni") / "m", seed=4, tokenizer=train_tokenizer())[0]


def interval(i):
    rng = np.random.default_rng(i)
    frames = [rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(2)]
    events = [{"type": "comment", "user": "amy", "text": f"how much is link {i}?"},
              {"type": "audio", "waveform": rng.standard_normal(16000 // 2).astype(np.float32) * 0.1},
              {"type": "video", "frames": frames}]
    if i % 2:  # the wire forms too: base64 WAV, data-URL frames
        events[1] = {"type": "audio", "data": wav_b64(0.5, seed=i)}
        events[2] = {"type": "video", "frames": [image_url(i, (32, 32)), image_url(i + 50, (32, 32))]}
    return events


def test_twenty_intervals_of_audio_and_video(checkpoint):
    llm = LLM(checkpoint, device="cpu", num_kv_blocks=256, block_size=16, max_model_len=2048)
    s = LiveSession(llm, "You watch a live stream. Decide each interval.", max_context=900, keep_intervals=2)
    stats = llm.core.stats
    compactions = last_compaction = 0
    for i in range(20):
        before, misses = len(s.ids), stats()["encoder_cache_misses"]
        d = s.step(interval(i))
        m = d.metrics
        assert stats()["encoder_cache_misses"] == misses + 2  # only this interval's audio and video are encoded
        assert [p.item.kind for p in s.media[-2:]] == ["audio", "video"]
        if m.compacted:
            compactions += 1
            # the media of earlier intervals are gone; their text lines stay
            assert len(s.media) == 2 and "audio: 0.5 s" in s.records[-1][0]
            assert m.compaction_tokens == m.prompt_tokens - m.cached_prompt_tokens > 0
        elif i > 0:
            new = m.prompt_tokens - before
            assert len(s.media) == 2 * (i + 1 - last_compaction)
            # everything but the new events (media included) and the previous decision's end token
            assert m.cached_prompt_tokens == m.prompt_tokens - new - 1
        if m.compacted:
            last_compaction = i
        assert stats()["encoder_cache_hits"] == 0  # earlier intervals' media come from the KV cache, not re-encoded
    assert compactions >= 2
    s.close()


def test_bad_media_events_are_refused_naming_them(checkpoint):
    llm = LLM(checkpoint, device="cpu", num_kv_blocks=64, block_size=16)
    s = LiveSession(llm, "You watch a live stream.")
    cases = [([{"type": "audio", "data": wav_b64(0.3, rate=8000)}], MediaError, "events\\[0\\].*8000 Hz"),
             ([{"type": "comment", "user": "a", "text": "x"}, {"type": "video", "frames": []}], MediaError,
              "events\\[1\\].*non-empty"),
             ([{"type": "audio", "data": "x", "path": "/a.wav"}], RequestError, "one of"),
             ([{"type": "video", "frames": [base64.b64encode(b"junk").decode()]}], MediaError, "not a readable"),
             ([{"type": "audio", "path": "/etc/hostname"}], MediaError, "not a PCM WAV")]
    for events, error, message in cases:
        with pytest.raises(error, match=message):
            s.step(events)
    assert s.num_intervals == 0 and s.media == []
    closed = LiveSession(llm, "You watch.", local_media_root=None)
    with pytest.raises(MediaError, match="local paths are not allowed"):
        closed.step([{"type": "audio", "path": "/etc/hostname"}])
