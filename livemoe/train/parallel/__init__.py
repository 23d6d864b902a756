"""Training-side parallelism on one torchrun device mesh: the mesh itself, the expert-parallel MoE layer around
fused_moe's kernels (all-to-all dispatch and combine), `parallelize`, which applies expert parallel and FSDP2 to a
model, and gradient-norm clipping over the shards. The decoder's tensor / expert parallel layers are part of the
model (livemoe/engine/model/tensor_parallel.py) and its worker processes part of the decoder
(livemoe/engine/decoder/workers.py)."""
from livemoe.train.parallel.all_to_all import all_to_all
from livemoe.train.parallel.expert_parallel import ExpertParallel, ep_fused_moe
from livemoe.train.parallel.grad_norm import clip_grad_norm_
from livemoe.train.parallel.mesh import ParallelDims, ParallelMesh, destroy_distributed, init_distributed
from livemoe.train.parallel.parallelize import apply_expert_parallel, apply_fsdp, parallelize

__all__ = ["all_to_all", "ExpertParallel", "ep_fused_moe", "ParallelDims", "ParallelMesh", "init_distributed",
           "destroy_distributed", "parallelize", "apply_expert_parallel", "apply_fsdp", "clip_grad_norm_"]
