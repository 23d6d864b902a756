"""experiments.live_media's cues (what a change's clip sounds like) and scripts/audio_cue_separation.py's measure."""
import numpy as np
import pytest

from experiments import live_media
from test_pretrain_student import load_script

RATE = 16000
separation = load_script("audio_cue_separation").separation


def plain(speech: np.ndarray) -> np.ndarray:
    n = int(live_media.CLIP_SECONDS * RATE)
    return np.pad(speech[:n], (0, max(0, n - len(speech))))


@pytest.mark.parametrize("cue", sorted(live_media.CUES))
def test_each_cue_marks_the_clips_first_second_and_keeps_the_speech(cue):
    speech = np.random.default_rng(1).normal(0, 0.1, 2 * RATE).astype(np.float32)
    heard = plain(live_media.CUES[cue](speech))
    assert not np.allclose(heard[:RATE], plain(speech)[:RATE])  # the tower's first chunk hears the cue
    # the speech is still in it, from the start or after one or two seconds of cue, cut at the clip's end
    kept = [np.corrcoef(heard[k:k + len(speech)], speech[:len(heard) - k])[0, 1] for k in (0, RATE, 2 * RATE)]
    assert max(kept) > 0.4, kept


def test_the_hiss_is_the_same_every_time_and_about_6_db_over_speech():
    a, b = live_media.hiss(), live_media.hiss()
    assert np.array_equal(a, b) and len(a) == live_media.CLIP_SECONDS * RATE
    assert 0.19 < a.std() < 0.21
    assert live_media.CUE in live_media.CUES


def test_an_unknown_cue_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="cue 'gong': not one of"):
        live_media.clip("news! link 3 is now 20 dollars", str(tmp_path), "gong")


def test_separation_is_class_mean_distance_over_spread():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (200, 4))
    label = np.arange(200) < 50
    assert separation(x, label) < 0.5  # one cloud, split at random
    x[label, 0] += 10.0
    assert 4.5 < separation(x, label) < 5.5  # means 10 apart over a spread of 2 (the RMS of 4 unit dimensions)
