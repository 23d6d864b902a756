"""MA-MSFT and SM-GSPO over live sessions that hear and see, on a tiny Qwen3-Omni-MoE thinker: the trainers lay out
a session's audio and video exactly as a LiveSession does, their batched forward over media equals transformers'
logits, the encoders stay frozen (their projectors train with --train_projector), and what cannot work is refused."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from livemoe.engine import load_model, load_tokenizer
from livemoe.engine.live.session import LiveSession
from livemoe.engine.multimodal.media import MediaItem, PlacedMedia
from livemoe.train.live import omni
from livemoe.train.live.data import check_session, encode_session, has_media
from livemoe.train.live.gspo import GSPOOptions, train_gspo, session_turns
from livemoe.train.live.msft import MSFTOptions, train_msft
from livemoe.train.live.world import LiveWorldConfig, make_sessions
from livemoe.train.live.trainer import engine_for
from test_omni_thinker import PROMPTS, build_prompt, reference_logits
from tiny_omni import make_omni_checkpoint
from tiny_tokenizer import make_text_checkpoint, train_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_omni_checkpoint(tmp_path_factory.mktemp("live_train_omni") / "m", seed=5, tokenizer=train_tokenizer())[0]


def media_sessions(n: int, seed: int = 0, intervals: int = 2) -> list:
    """World sessions with an audio event (a tone, a different pitch each interval) and a video event (one random
    32x32 frame) in every interval, in the Python forms (waveform, frames)."""
    out = []
    for s in make_sessions(n, seed, LiveWorldConfig(num_intervals=intervals)):
        rng = np.random.default_rng(seed)
        ivs = []
        for i, iv in enumerate(s["intervals"]):
            tone = np.sin(2 * np.pi * (200 + 50 * i) * np.arange(4000) / 16000).astype(np.float32) * 0.3
            frame = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
            ivs.append({**iv, "events": iv["events"] + [{"type": "audio", "waveform": tone},
                                                         {"type": "video", "frames": [frame]}]})
        out.append({**s, "intervals": ivs})
    return out


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def changed(before: dict, model) -> set:
    return {k for k, v in model.named_parameters() if not torch.equal(before[k], v.detach())}


def test_the_trainers_lay_out_media_as_a_live_session(checkpoint):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    llm = engine_for(model, tok)
    session = media_sessions(1, seed=1, intervals=3)[0]
    live = LiveSession(llm, session["system"], max_message_chars=96)
    decided = [live.step(iv["events"], t=iv["t"]) for iv in session["intervals"]]
    # SM-GSPO's turns with the decoder's own decision tokens in between: the session's context, token for token
    first, nexts = session_turns(session, tok, llm.media_processor)
    ids, media = list(first.prompt_ids), list(first.media)
    for record, turn in zip(live.records, [*nexts, None]):
        ids += record[1]
        if turn is not None:
            media += [PlacedMedia(m.item, len(ids) + m.offset) for m in turn.media]
            ids += turn.prompt_ids
    assert ids == live.ids
    assert [(m.offset, m.item.content_hash) for m in media] == [(m.offset, m.item.content_hash) for m in live.media]
    assert len(media) == 6
    # MA-MSFT's encoding: the same intervals around the decisions' own tokenization
    enc = encode_session(session, tok, tok.eos_token_id, decisions=[d.text for d in decided],
                         processor=omni.media_processor(model))
    assert [m.item.content_hash for m in enc.media] == [m.item.content_hash for m in media]
    assert enc.input_ids[:len(first.prompt_ids)] == first.prompt_ids
    for m in enc.media:
        assert enc.input_ids[m.offset - 1] in (model.config.omni.audio_start_token_id,
                                               model.config.omni.vision_start_token_id)
    live.close()


def test_batched_media_forward_equals_transformers(tmp_path):
    """Two right-padded rows with different media, the same item twice: each row's logits are transformers' for that
    prompt alone within 1e-4 (fp32; the thinker parity's tolerance)."""
    path, hf = make_omni_checkpoint(tmp_path / "m", seed=3)
    model = load_model(path)
    g = torch.Generator().manual_seed(7)
    rows, refs = [], []
    for name in ("video_audio_text", "two_images_audio_video"):
        ids, spans = build_prompt(g, PROMPTS[name])
        ref, audio, images, videos = reference_logits(hf, ids, spans, g)
        audio, vision = iter(audio), iter(images + videos)
        placed = []
        for span in spans:
            if span.kind == "audio":
                item = MediaItem("audio", next(audio), span.length)
            else:
                pixels, grid, seconds = next(vision)
                item = MediaItem(span.kind, pixels, span.length, grid, seconds)
            placed.append(PlacedMedia(item, span.offset))
        rows.append((ids, placed))
        refs.append(ref[0])
    T = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for b, (ids, _) in enumerate(rows):
        input_ids[b, :len(ids)] = torch.tensor(ids)
        mask[b, :len(ids)] = 1
    with torch.no_grad():
        hidden = omni.forward_hidden(model, input_ids, mask, [p for _, p in rows], return_router_logits=False)
        logits = model.compute_logits(hidden)
    for b, ref in enumerate(refs):
        assert (logits[b, :len(ref)] - ref).abs().max().item() <= 1e-4
        assert ref.abs().max().item() > 1e-2


@pytest.mark.parametrize("train_projector", [False, True])
def test_msft_trains_the_language_model_with_frozen_encoders(checkpoint, train_projector):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    sessions = media_sessions(3, seed=2)
    before = snapshot(model)
    out = train_msft(model, tok, sessions, MSFTOptions(steps=2, batch_size=2, lr=1e-2, warmup_steps=0,
                                                       train_projector=train_projector), log=lambda _: None)
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in out["history"])
    moved = changed(before, model)
    assert {k for k in moved if k.startswith(("model.", "lm_head."))}  # the language model trains
    encoders = {k for k in before if k.startswith(omni.ENCODERS)}
    projectors = {k for k in encoders if k.startswith(omni.PROJECTORS)}
    assert not moved & (encoders - projectors)  # the encoders' trunks never move
    assert (moved & projectors == projectors) if train_projector else not moved & projectors
    assert {k for k in projectors if k.startswith("audio_tower.")} and {k for k in projectors
                                                                      if k.startswith("visual.merger_list.")}


@pytest.mark.parametrize("train_projector", [False, True])
def test_gspo_step_over_media_sessions(checkpoint, train_projector):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    sessions = media_sessions(2, seed=3)
    before = snapshot(model)
    opts = GSPOOptions(steps=1, sessions_per_step=2, num_generations=2, lr=1e-2, max_message_chars=16,
                       train_projector=train_projector)
    out = train_gspo(model, tok, sessions, opts, log=lambda _: None, num_kv_blocks=256)
    row = out["history"][0]
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]) and row["parsed"] == 1.0
    moved = changed(before, model)
    projectors = {k for k in before if k.startswith(omni.PROJECTORS)}
    trunks = {k for k in before if k.startswith(omni.ENCODERS)} - projectors
    assert not moved & trunks
    assert row["adv_nonzero"] > 0 and row["grad_norm"] > 0  # seeded: trajectories that differ, so a gradient
    assert {k for k in moved if k.startswith("model.")}
    assert bool(moved & projectors) == train_projector


def test_what_cannot_work_is_refused(tmp_path, checkpoint):
    text_path, _ = make_text_checkpoint(tmp_path / "text", moe=True)
    model, tok = load_model(text_path), load_tokenizer(text_path)
    with pytest.raises(ValueError, match="text model.*no projector"):
        train_msft(model, tok, make_sessions(1, 0), MSFTOptions(steps=1, train_projector=True), log=lambda _: None)
    from livemoe.engine.errors import RequestError
    with pytest.raises(RequestError, match="need a model that takes media"):
        train_msft(model, tok, media_sessions(1), MSFTOptions(steps=1), log=lambda _: None)
    from livemoe.train.data import DataError
    session = make_sessions(1, 0)[0]
    session["intervals"][0]["events"] = [{"type": "audio", "path": "a.wav", "data": "x"}]
    with pytest.raises(DataError, match=r"intervals\[0\]: events\[0\]: a audio event has type and one of"):
        check_session(session, "s.jsonl:1")
    assert has_media(media_sessions(1)) and not has_media(make_sessions(1, 0))


def test_the_command_refuses_what_a_text_checkpoint_cannot_do(tmp_path, checkpoint):
    from livemoe.train.config import ConfigError, parse_config
    from livemoe.train.live.config import LiveConfig
    from livemoe.train.live.data import save_sessions

    heard = make_sessions(1, 0)
    heard[0]["intervals"][0]["events"].append({"type": "audio", "path": str(tmp_path / "a.wav")})
    save_sessions(heard, str(tmp_path / "heard.jsonl"))
    cases = [(["--train_projector"], "--train_projector: --model .* is a text checkpoint"),
             (["--data", str(tmp_path / "heard.jsonl")], "heard.jsonl has audio / video events; --model .* text"),
             (["--eval_data", str(tmp_path / "heard.jsonl")], "--eval_data .* has audio / video events"),
             (["--media_mode", "said"], "text checkpoint, which cannot hear or see|espeak-ng"),
             (["--media_mode", "loud", "--model", checkpoint], "media_mode must be one of"),
             (["--media_mode", "said", "--model", checkpoint, "--data", str(tmp_path / "heard.jsonl")],
              "--media_mode renders the synthetic world")]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_config(LiveConfig, argv)
    cfg = parse_config(LiveConfig, ["--model", checkpoint, "--train_projector", "--data", str(tmp_path / "heard.jsonl")])
    assert cfg.msft.train_projector and cfg.gspo.train_projector  # one flag, both stages
    assert not parse_config(LiveConfig, []).msft.train_projector  # frozen by default


def test_multi_turn_media_land_where_each_trajectory_put_them():
    """A later turn's media sit after that trajectory's own sampled tokens (trajectories of different lengths place
    the same item at different offsets), and each turn is sampled from a MultimodalPrompt holding all media so far."""
    from livemoe.engine.multimodal.media import MultimodalPrompt
    from livemoe.train.rollout import Completion, multi_turn_trajectories

    item = MediaItem("audio", torch.randn(4, 100), 3)
    first = MultimodalPrompt([7, 8, 50, 0, 0, 0, 51, 9], [PlacedMedia(item, 3)])
    later = MultimodalPrompt([10, 50, 0, 0, 0, 51, 11], [PlacedMedia(item, 2)])
    seen = []

    def sample(prompts, seeds):
        seen.extend(prompts)
        return [Completion([], [60] * (1 + i), [0.0] * (1 + i), "x", "stop") for i in range(len(seeds))]

    groups = multi_turn_trajectories([first], [[later]], 0, 0, 3, None, lambda p: list(p), sample)
    offsets = set()
    for c in groups[0]:
        whole = c.prompt_ids + c.token_ids
        assert [m.offset for m in c.media][0] == 3
        for m in c.media:
            assert whole[m.offset - 1] == 50 and whole[m.offset:m.end] == [0, 0, 0]
        offsets.add(c.media[1].offset)
    assert len(offsets) == 3  # first turns of 1, 2 and 3 tokens: the later item lands at three places
    assert all(isinstance(p, MultimodalPrompt) for p in seen)
    assert {len(p.media) for p in seen} == {1, 2}


def test_remote_rollouts_refuse_media():
    from livemoe.engine.multimodal.media import MultimodalPrompt
    from livemoe.train.remote_rollout import RemoteRollouts

    remote = RemoteRollouts.__new__(RemoteRollouts)  # no server: the refusal comes before any request
    prompt = MultimodalPrompt([1, 2, 3], [PlacedMedia(MediaItem("audio", torch.zeros(4, 10), 1), 1)])
    with pytest.raises(ValueError, match="in-process decoder"):
        remote.generate_multi_turn([prompt], [[]], 0, max_new_tokens=8)


@pytest.mark.skipif(shutil.which("espeak-ng") is None,
                    reason="--media_mode speaks the host's lines with espeak-ng, which is not installed")
def test_the_command_trains_both_stages_on_the_heard_world(tmp_path, checkpoint):
    from livemoe.train.live.__main__ import main

    out = tmp_path / "run"
    argv = ["--model", checkpoint, "--media_mode", "said", "--media_cache", str(tmp_path / "media"),
            "--train_sessions", "2", "--eval_sessions", "1", "--num_intervals", "2", "--sft_steps", "1",
            "--gspo_steps", "1", "--sessions_per_step", "1", "--num_generations", "2", "--max_message_chars", "16",
            "--max_len", "2048", "--output_dir", str(out), "--progress", "false"]
    assert main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert list(rows) == ["base student", "MA-MSFT", "SM-GSPO"] and all(r["intervals"] == 2 for r in rows.values())
    start, trained = load_model(checkpoint), load_model(str(out / "gspo" / "model"))
    assert omni.takes_media(trained)
    before, after = dict(start.named_parameters()), dict(trained.named_parameters())
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(omni.ENCODERS))  # frozen: saved as-is
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("model."))
    assert any(f.endswith(".wav") for f in os.listdir(tmp_path / "media"))
