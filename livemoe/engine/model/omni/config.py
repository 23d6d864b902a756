"""OmniConfig: the thinker's fields beyond its text model (placeholder token ids, the encoders' sub-configs, the
multimodal rotary layout), parsed from a Qwen3-Omni-MoE config.json: the whole model's (`qwen3_omni_moe`, thinker under
`thinker_config`) or a thinker alone (`qwen3_omni_moe_thinker`, as transformers saves one)."""
from dataclasses import dataclass, field

OMNI_MODEL_TYPES = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")


@dataclass(kw_only=True)
class OmniConfig:
    audio_token_id: int
    image_token_id: int
    video_token_id: int
    audio_start_token_id: int
    vision_start_token_id: int
    audio_end_token_id: int  # the markers after an item (the hub's config names only the starts: start + 1)
    vision_end_token_id: int
    position_id_per_seconds: float
    mrope_section: list[int]  # frequencies of the head dim given to (time, height, width), interleaved
    audio_config: dict = field(default_factory=dict, repr=False)
    vision_config: dict = field(default_factory=dict, repr=False)

    @property
    def spatial_merge_size(self) -> int:
        return int(self.vision_config.get("spatial_merge_size", 2))

    @property
    def placeholder_ids(self) -> tuple[int, int, int]:
        return self.audio_token_id, self.image_token_id, self.video_token_id


def thinker_dict(raw: dict) -> dict:
    """The thinker's part of a config dict (the whole model nests it under thinker_config)."""
    return raw["thinker_config"] if raw.get("model_type") == "qwen3_omni_moe" else raw


def parse_omni(raw: dict, fail) -> tuple[dict, OmniConfig]:
    """-> (the text model's dict, OmniConfig); `fail(msg)` raises naming the file."""
    thinker = thinker_dict(raw)
    if not isinstance(thinker, dict):
        fail("thinker_config must be an object")
    for key in ("text_config", "audio_config", "vision_config"):
        if not isinstance(thinker.get(key), dict):
            fail(f"missing required object {key!r} in the thinker's config")
    text = thinker["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not (isinstance(section, list) and len(section) == 3 and all(isinstance(s, int) and s >= 0 for s in section)):
        fail(f"text_config.rope_parameters.mrope_section must be 3 non-negative integers, got {section!r}")
    if rope.get("mrope_interleaved") is False:
        fail("mrope_interleaved=false is not supported (Qwen3-Omni interleaves its rotary sections)")
    vision = thinker["vision_config"]
    for name, sub, key in (("audio_config", thinker["audio_config"], "output_dim"),
                           ("vision_config", vision, "out_hidden_size")):
        if sub.get(key) != text.get("hidden_size"):
            fail(f"{name}.{key}={sub.get(key)!r} must equal text_config.hidden_size={text.get('hidden_size')!r} "
                 "(the encoders' rows replace token embeddings)")
    if vision.get("rope_parameters", {}).get("rope_type", "axial") != "axial":
        fail("vision_config.rope_parameters.rope_type must be 'axial'")
    ids = {}
    for key, default in (("audio_token_id", 151646), ("image_token_id", 151655), ("video_token_id", 151656),
                         ("audio_start_token_id", 151647), ("vision_start_token_id", 151652)):
        value = thinker.get(key, default)
        if not isinstance(value, int) or value < 0:
            fail(f"{key} must be a non-negative integer, got {value!r}")
        ids[key] = value
    for kind in ("audio", "vision"):
        ids[f"{kind}_end_token_id"] = int(thinker.get(f"{kind}_end_token_id", ids[f"{kind}_start_token_id"] + 1))
    vocab = text.get("vocab_size", 0)
    for key, value in ids.items():
        if value >= vocab:
            fail(f"{key}={value} is outside the text model's vocab_size={vocab}")
    omni = OmniConfig(**ids, position_id_per_seconds=float(thinker.get("position_id_per_seconds", 25)),
                      mrope_section=list(section), audio_config=dict(thinker["audio_config"]),
                      vision_config=dict(vision))
    return text, omni
