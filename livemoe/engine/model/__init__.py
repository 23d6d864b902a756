"""The model and everything about checkpoints: config, the Qwen3 dense / MoE model and its layers, paged
attention, the decoder's tensor-parallel layers, loading and saving, in-place weight updates, the MoE
load-balancing loss, the per-step context, FLOPs, the serving memory planner and the published presets."""
