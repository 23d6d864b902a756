"""Media inputs of the Qwen3-Omni-MoE thinker: decoding (WAV with the stdlib, images and animated GIF/WebP video with
PIL), the encoders' input features, chat content parts, and the encoder cache."""
