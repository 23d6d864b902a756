"""The Qwen3-Omni-MoE thinker against transformers' (fp32, tiny random configs transformers makes): logits for
text-only, audio+text, image+text and video+audio+text prompts, and the multimodal rotary positions.

Tolerance 1e-4 max abs, as the text models' parity: the same fp32 ops up to summation order in matmuls. The encoders
are transformers' modules, so the difference is the language model's, our kernels against transformers' eager path."""
import pytest
import torch

from livemoe import engine
from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.omni.positions import MediaSpan, audio_token_count, mrope_positions, vision_token_count
from livemoe.engine.model.omni.thinker import MediaPiece, OmniThinkerForCausalLM
from tiny_omni import (AUDIO, AUDIO_END, AUDIO_START, IMAGE, MEL_BINS, MERGE, PATCH_DIM, VIDEO, VISION_END,
                       VISION_START, make_omni_checkpoint)


def text(g, n):
    return torch.randint(3, 180, (n,), generator=g).tolist()


def build_prompt(g, media):
    """media: [(kind, spec)] with spec = frames (audio) or (grid_thw, seconds_per_grid) (vision) -> ids, spans."""
    ids, spans = text(g, 5), []
    for kind, spec in media:
        if kind == "audio":
            n = audio_token_count(spec, 50)
            ids += [AUDIO_START]
            spans.append(MediaSpan("audio", len(ids), n))
            ids += [AUDIO] * n + [AUDIO_END]
        else:
            grid, seconds = spec
            n = vision_token_count(grid, MERGE)
            ids += [VISION_START]
            spans.append(MediaSpan(kind, len(ids), n, grid, seconds))
            ids += [IMAGE if kind == "image" else VIDEO] * n + [VISION_END]
        ids += text(g, 4)
    return ids, spans


PROMPTS = {
    "text": [],
    "audio_text": [("audio", 130)],  # a 100-frame chunk and a 30-frame tail
    "image_text": [("image", ((1, 4, 6), 1.0))],
    "video_audio_text": [("audio", 57), ("video", ((3, 4, 4), 0.5))],
    "two_images_audio_video": [("image", ((1, 2, 4), 1.0)), ("audio", 205), ("image", ((1, 4, 2), 1.0)),
                               ("video", ((2, 2, 2), 2.0))],
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path, hf = make_omni_checkpoint(tmp_path_factory.mktemp("omni") / "thinker", seed=3)
    return engine.load_model(path, device="cpu"), hf


def reference_logits(hf, ids, spans, g):
    """transformers' logits for the prompt, with fresh random media; also returns the media."""
    kw, audio, images, videos = {}, [], [], []
    for span in spans:
        if span.kind == "audio":
            frames = next(f for f in range(1, 1000) if audio_token_count(f, 50) == span.length)
            audio.append(torch.randn(MEL_BINS, frames, generator=g))
        else:
            t, h, w = span.grid_thw
            (images if span.kind == "image" else videos).append((torch.randn(t * h * w, PATCH_DIM, generator=g),
                                                                  span.grid_thw, span.seconds_per_grid))
    if audio:
        longest = max(a.shape[1] for a in audio)
        kw["input_features"] = torch.stack([torch.nn.functional.pad(a, (0, longest - a.shape[1])) for a in audio])
        kw["feature_attention_mask"] = torch.stack([torch.arange(longest) < a.shape[1] for a in audio]).long()
    if images:
        kw["pixel_values"] = torch.cat([p for p, _, _ in images])
        kw["image_grid_thw"] = torch.tensor([list(grid) for _, grid, _ in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([p for p, _, _ in videos])
        kw["video_grid_thw"] = torch.tensor([list(grid) for _, grid, _ in videos])
        kw["video_second_per_grid"] = torch.tensor([s for _, _, s in videos])
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kw)
    return out.logits, audio, images, videos


def our_logits(model, ids, spans, audio, images, videos):
    audio, images, videos = iter(audio), iter(images), iter(videos)
    pieces = []
    with torch.no_grad():
        for span in spans:
            if span.kind == "audio":
                media = model.encode_audio(next(audio))
            else:
                pixels, grid, _ = next(images if span.kind == "image" else videos)
                media = model.encode_vision(pixels, grid)
            assert media.embeds.shape[0] == span.length
            pieces.append(MediaPiece(span.offset, media, 0, span.length))
        positions, _ = mrope_positions(len(ids), spans, model.config.omni)
        return model(torch.tensor([ids]), positions.float()[:, None, :], pieces=pieces)


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_logits_match_transformers(pair, prompt):
    model, hf = pair
    g = torch.Generator().manual_seed(len(prompt))
    ids, spans = build_prompt(g, PROMPTS[prompt])
    ref, audio, images, videos = reference_logits(hf, ids, spans, g)
    ours = our_logits(model, ids, spans, audio, images, videos)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4
    assert ref.abs().max().item() > 1e-2  # the logits say something (a zero model would pass trivially)


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_positions_equal_transformers_rope_index(pair, prompt):
    model, hf = pair
    g = torch.Generator().manual_seed(7 + len(prompt))
    ids, spans = build_prompt(g, PROMPTS[prompt])
    frames = [next(f for f in range(1, 1000) if audio_token_count(f, 50) == s.length) for s in spans
              if s.kind == "audio"]
    grids = {k: [list(s.grid_thw) for s in spans if s.kind == k] or None for k in ("image", "video")}
    seconds = torch.tensor([s.seconds_per_grid for s in spans if s.kind == "video"]) if grids["video"] else None
    input_ids = torch.tensor([ids])
    ref, delta = hf.model.get_rope_index(
        input_ids, torch.tensor(grids["image"]) if grids["image"] else None,
        torch.tensor(grids["video"]) if grids["video"] else None, torch.ones_like(input_ids), False,
        torch.tensor(frames) if frames else None, seconds)
    ours, our_delta = mrope_positions(len(ids), spans, model.config.omni)
    assert torch.equal(ours.float(), ref[:, 0].float())
    assert our_delta == pytest.approx(float(delta.flatten()[0]))


def test_hub_layout_loads_and_skips_the_talker(tmp_path):
    path, hf = make_omni_checkpoint(tmp_path / "whole", seed=5, layout="hub")
    model = engine.load_model(path, device="cpu")
    assert isinstance(model, OmniThinkerForCausalLM) and model.config.model_type == "qwen3_omni_moe"
    ids = torch.randint(3, 180, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids) - hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits).abs().max() <= 1e-4
    # saved, it is a thinker alone (no talker was loaded), which our loader and transformers' thinker read
    saved = engine.save_model(model, str(tmp_path / "saved"))
    assert engine.load_config(saved).model_type == "qwen3_omni_moe_thinker"
    with torch.no_grad():
        assert torch.equal(engine.load_model(saved, device="cpu")(ids), model(ids))


def test_text_only_rotary_is_plain_rope(pair):
    """Positions equal on the three axes are plain RoPE: the decode path's [B, T] positions give the same cos/sin."""
    model, _ = pair
    pos = torch.arange(11)[None]
    plain = model.model.rotary_emb(pos, torch.float32)
    three = model.model.rotary_emb(pos.float().expand(3, 1, -1), torch.float32)
    assert torch.equal(plain[0], three[0]) and torch.equal(plain[1], three[1])


def test_bad_omni_config_is_refused(tmp_path):
    import json
    from tiny_omni import thinker_config

    raw = thinker_config().to_dict()
    raw["text_config"]["rope_parameters"]["mrope_section"] = [2, 3]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="mrope_section"):
        engine.load_config(str(tmp_path))


def test_save_and_load_round_trip(pair, tmp_path):
    """save_model writes the thinker in transformers' thinker layout (encoders included); loading it back, and
    transformers loading it, give the same logits."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    model, hf = pair
    path = engine.save_model(model, str(tmp_path / "saved"))
    again = engine.load_model(path, device="cpu")
    g = torch.Generator().manual_seed(11)
    ids, spans = build_prompt(g, PROMPTS["image_text"])
    _, audio, images, videos = reference_logits(hf, ids, spans, g)
    assert torch.equal(our_logits(model, ids, spans, audio, images, videos),
                       our_logits(again, ids, spans, audio, images, videos))
    theirs = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(path).eval()
    x = torch.tensor([ids[:6]])
    with torch.no_grad():
        assert (theirs(input_ids=x, attention_mask=torch.ones_like(x)).logits - again(x)).abs().max() <= 1e-4


def test_weights_update_from_a_saved_thinker(tmp_path):
    """A thinker loaded from the whole model's layout takes a saved thinker's weights (update_weights_from_disk)."""
    from livemoe import LLM

    path, _ = make_omni_checkpoint(tmp_path / "whole", seed=5, layout="hub")
    other, _ = make_omni_checkpoint(tmp_path / "other", seed=6)
    llm = LLM(path, device="cpu", num_kv_blocks=16)
    ids = torch.randint(3, 180, (1, 7), generator=torch.Generator().manual_seed(0))
    assert llm.update_weights_from_disk(other) > len(list(llm.model.named_parameters()))  # per-expert keys
    with torch.no_grad():
        assert torch.equal(llm.model(ids), engine.load_model(other, device="cpu")(ids))
