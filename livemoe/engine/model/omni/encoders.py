"""The thinker's audio and vision encoders. These are transformers' own modules (models/qwen3_omni_moe), used as they
are: they run once per media item, off the decode path, so our kernels would buy little there, and reusing them keeps
their numerics transformers' by construction. The language model they feed is ours (livemoe.engine.model.qwen3)."""
import torch

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.omni.config import OmniConfig


def _hf():
    try:
        from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as conf
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling
    except ImportError as e:
        raise CheckpointError("the Qwen3-Omni-MoE thinker's encoders come from transformers' models/qwen3_omni_moe, "
                              f"which this transformers cannot import ({e}); install transformers >= 5.0") from None
    return conf, modeling


def build_encoders(omni: OmniConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """-> (audio_tower, visual), with the hub's parameter names under those prefixes."""
    conf, modeling = _hf()
    try:
        audio_cfg = conf.Qwen3OmniMoeAudioEncoderConfig.from_dict(omni.audio_config)
        vision_cfg = conf.Qwen3OmniMoeVisionEncoderConfig.from_dict(omni.vision_config)
    except Exception as e:  # noqa: BLE001 (transformers' config validation raises several types)
        raise CheckpointError(f"the thinker's audio_config / vision_config is invalid ({e})") from None
    return (modeling.Qwen3OmniMoeAudioEncoder._from_config(audio_cfg),
            modeling.Qwen3OmniMoeVisionEncoder._from_config(vision_cfg))


def init_encoder_buffers(audio_tower: torch.nn.Module, visual: torch.nn.Module, device) -> None:
    """Recomputes the encoders' non-persistent buffers (sinusoid table, axial rotary frequencies), which a model
    made on the meta device lacks and a checkpoint does not hold."""
    table = audio_tower.positional_embedding
    table.register_buffer("positional_embedding", table.compute_default_singular_positional_embedding().to(device),
                          persistent=False)
    rotary = visual.rotary_pos_emb
    inv_freq, _ = rotary.compute_axial_rope_parameters(rotary.config)
    rotary.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
    rotary.register_buffer("original_inv_freq", inv_freq.clone().to(device), persistent=False)
