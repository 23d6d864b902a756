"""The Qwen3-Omni-MoE thinker in the decoder (issue 36), each against its baseline in the same process, run
alternately:
- text-only decode: the thinker serving text requests against the plain Qwen3-MoE holding the same language-model
  weights (the thinker's LM is that module; only its encoders and the multimodal positions are added, and a text
  request takes none of them): decode tok/s of 16 requests (quick: 4) x 64 tokens (quick: 8);
- a media item's prefill: a prompt with one image and one audio clip, the encoders run (encoder cache cold) against
  the same prompt whose items are in the encoder cache (prefix caching off, so the LM prefill is the same work).

- live decision latency per interval with audio + video events (a comment, 0.5 s of audio, two 32x32 frames) at 1, 8
  and 32 sessions (32: --benchmark-full): the sessions' cached contexts against re-prefilling the whole context each
  interval.

CPU: a random thinker with the small MoE of bench_decode as its LM (H 256, 4 layers, 32 experts top-4, vocab 4096)
and small encoders, fp32, one thread; medians of 5 alternating runs (quick: 1; live: 3, 1 at 32 sessions).
"""
import itertools
import statistics
import time

import numpy as np
import pytest
import torch

from bench.bench_decode import MODELS, random_prompts
from bench.common import median_pair, play_live, record
from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams

SUITE = "omni"
pytestmark = pytest.mark.usefixtures("one_thread")
LM = dict(MODELS["small MoE"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [6, 5, 5], "mrope_interleaved": True})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tiny_omni import make_omni_checkpoint

    return make_omni_checkpoint(tmp_path_factory.mktemp("bench_omni") / "thinker", seed=0, eos_token_id=None,
                                **LM)[0]


def text_twin(llm: LLM) -> LLM:
    """An engine over a plain Qwen3-MoE module holding the thinker's language-model weights."""
    from dataclasses import replace

    from livemoe.engine.model.qwen3 import Qwen3ForCausalLM

    thinker = llm.model
    cfg = replace(thinker.config, omni=None, model_type="qwen3_moe")
    plain = Qwen3ForCausalLM(cfg).eval()
    missing, _ = plain.load_state_dict(thinker.state_dict(), strict=False)
    assert not missing, missing
    return LLM.from_model(plain, None, num_kv_blocks=1024, use_tqdm=False)


def decode_tps(llm: LLM, prompts, new: int):
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def test_text_only_decode_on_the_thinker(ckpt, bench_mode):
    num, new, reps = (16, 64, 5) if bench_mode == "full" else (4, 8, 1)
    thinker = LLM(ckpt, dtype=torch.float32, device="cpu", num_kv_blocks=1024, use_tqdm=False)
    plain = text_twin(thinker)
    prompts = random_prompts(num, 8, 48, LM["vocab_size"] - 8)
    for llm in (thinker, plain):
        decode_tps(llm, prompts[:2], 2)  # warm-up
    t_ours, ours, t_base, base = median_pair(lambda: decode_tps(thinker, prompts, new),
                                             lambda: decode_tps(plain, prompts, new), reps)
    assert ours == base  # the same LM, the same greedy tokens
    tokens = num * new
    record(suite=SUITE, case=f"text-only, {num} requests x {new} tokens", metric="tok/s", ours=tokens / t_ours,
           baseline=tokens / t_base, baseline_name="the same LM as a plain Qwen3-MoE", higher_is_better=True,
           kind="overhead", extra={"ours_s": t_ours, "baseline_s": t_base})


def test_media_prefill_with_and_without_the_encoder_cache(ckpt, bench_mode):
    from livemoe.engine.multimodal.media import MultimodalPrompt, PlacedMedia

    reps = 5 if bench_mode == "full" else 1
    llm = LLM(ckpt, dtype=torch.float32, device="cpu", num_kv_blocks=1024, use_tqdm=False,
              enable_prefix_caching=False)
    proc, omni = llm.media_processor, llm.model.config.omni
    rng = np.random.default_rng(0)
    image = proc.image_array(rng.integers(0, 255, (224, 320, 3), dtype=np.uint8), "image")
    audio = proc.audio_waveform(rng.standard_normal(16000 * 4).astype(np.float32) * 0.1, "audio")
    ids, media = [5] * 4, []
    for item, pad in ((image, omni.image_token_id), (audio, omni.audio_token_id)):
        media.append(PlacedMedia(item, len(ids)))
        ids += [pad] * item.num_tokens + [6] * 4
    prompt = MultimodalPrompt(ids, media)
    params = SamplingParams(temperature=0, max_tokens=1)
    cache = llm.core.runner.encoder_cache

    def prefill(cold: bool):
        if cold:
            cache.clear()
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - t0, None

    prefill(True)  # warm-up
    t_cold, _, t_warm, _ = median_pair(lambda: prefill(True), lambda: prefill(False), reps)
    record(suite=SUITE, case=f"prefill of {len(ids)} tokens ({image.num_tokens} image + {audio.num_tokens} audio)",
           metric="ms", ours=t_warm * 1e3, baseline=t_cold * 1e3, baseline_name="encoders run (cache cold)",
           extra={"encoder_share": statistics.mean([1 - t_warm / t_cold])})


@pytest.fixture(scope="module")
def ckpt_with_tokenizer(tmp_path_factory):
    from tiny_omni import make_omni_checkpoint
    from tiny_tokenizer import train_tokenizer

    return make_omni_checkpoint(tmp_path_factory.mktemp("bench_omni") / "live", seed=0, tokenizer=train_tokenizer(),
                                **LM)[0]


def media_events(i: int):
    """One interval: a comment, 0.5 s of audio, two 32x32 frames (one temporal patch)."""
    rng = np.random.default_rng(i)
    return [{"type": "comment", "user": "amy", "text": f"how much is link {i % 9}?"},
            {"type": "audio", "waveform": rng.standard_normal(8000).astype(np.float32) * 0.1},
            {"type": "video", "frames": [rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(2)]}]


_plays = itertools.count()


def play_media(llm: LLM, num_sessions: int, warm: int, timed: int):
    from livemoe.engine.live import LiveSession

    # a new system prompt each play: no play may hit blocks an earlier one left in the prefix cache
    play = next(_plays)
    sessions = [LiveSession(llm, f"you are the live assistant of room {i} (play {play}). decide each interval.",
                            max_message_chars=32) for i in range(num_sessions)]
    return play_live(sessions, media_events, warm, timed)


@pytest.mark.parametrize("num_sessions", [1, 8, 32])
def test_live_decision_latency_with_audio_and_video(ckpt_with_tokenizer, bench_mode, bench_long, num_sessions):
    """Per interval: the sessions' cached contexts (each interval prefills and encodes only its own events) against
    the same sessions with prefix caching off (every interval re-prefills the whole context; the earlier media's
    encoder outputs still come from the encoder cache)."""
    if bench_mode == "quick" and num_sessions > 1:
        pytest.skip("quick mode: 1 session (pytest bench/ --benchmark runs 8, --benchmark-full 32)")
    if num_sessions > 8 and not bench_long:
        pytest.skip("32 sessions: pytest bench/ --benchmark-full (minutes on 2 cores)")
    warm, timed, reps = (4, 3, 3 if num_sessions < 32 else 1) if bench_mode == "full" else (2, 2, 1)
    kw = dict(dtype=torch.float32, device="cpu", num_kv_blocks=4096, use_tqdm=False, max_model_len=4096,
              encoder_cache_bytes=2**30)
    cached = LLM(ckpt_with_tokenizer, **kw)
    uncached = LLM(ckpt_with_tokenizer, enable_prefix_caching=False, **kw)
    t_ours, stats, t_base, base_stats = median_pair(lambda: play_media(cached, num_sessions, warm, timed),
                                                    lambda: play_media(uncached, num_sessions, warm, timed), reps)
    record(suite=SUITE, case=f"live interval with audio + video, {num_sessions} session(s)", metric="ms/interval",
           ours=t_ours * 1e3, baseline=t_base * 1e3, baseline_name="re-prefill the context (no prefix cache)",
           extra={"prompt_tokens": stats[0], "cached_prompt_tokens": stats[1], "completion_tokens": stats[2],
                  "baseline_cached": base_stats[1]})
