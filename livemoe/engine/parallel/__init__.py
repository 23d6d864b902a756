"""Parallel building blocks shared by the trainers and the decoder: the device mesh of a torchrun job, the
expert-parallel MoE layer around fused_moe's kernels, `parallelize`, which applies expert parallel and FSDP2
to a model, and the decoder's tensor / expert parallel layers (tensor_parallel). Its worker processes are in
livemoe/engine/parallel/workers.py (imported where used: an engine with one process never loads them)."""
from livemoe.engine.parallel.all_to_all import all_to_all
from livemoe.engine.parallel.expert_parallel import ExpertParallel, ep_fused_moe
from livemoe.engine.parallel.grad_norm import clip_grad_norm_
from livemoe.engine.parallel.mesh import ParallelDims, ParallelMesh, destroy_distributed, init_distributed
from livemoe.engine.parallel.parallelize import apply_expert_parallel, apply_fsdp, parallelize
from livemoe.engine.parallel.tensor_parallel import TensorParallel, check_tensor_parallel

__all__ = ["all_to_all", "ExpertParallel", "ep_fused_moe", "ParallelDims", "ParallelMesh", "init_distributed",
           "destroy_distributed", "parallelize", "apply_expert_parallel", "apply_fsdp", "clip_grad_norm_",
           "TensorParallel", "check_tensor_parallel"]
