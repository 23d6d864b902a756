"""The Qwen3-Omni-MoE thinker: the Qwen3-MoE language model (ours) fed by an audio and a vision encoder
(transformers' modules), with time-aligned multimodal rotary positions. The talker (speech output) is not here."""
