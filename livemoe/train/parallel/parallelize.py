"""parallelize(model, mesh): expert parallel, then FSDP2, on the job's mesh (torchtitan's shape: one function
per parallelism, applied in order, composable on one mesh).

- apply_expert_parallel keeps this EP rank's experts of every MoE layer (a contiguous E/ep slice of the
  stacked gate_up_proj / down_proj) and points the experts at the EP MoE layer.
- apply_fsdp shards with fully_shard: each decoder layer is a unit over the `dp` mesh (all ranks); its experts,
  when expert parallel holds them, are a unit of their own over `dp_mod_ep` (the ranks holding the same
  experts); the root unit holds the embeddings, the final norm and the head. The root stays gathered from
  forward to backward (FSDP2's default for the root), so the head weight the fused log-prob kernels read
  outside any forward (model.lm_head_weight) is the full one, and a tied embedding shares its unit.
  Mixed precision: parameters gathered in `param_dtype` for compute, gradients reduced in `reduce_dtype`, the
  sharded parameters (what the optimizer updates: the master copy) and so the AdamW states stay in the
  dtype the model was built in (fp32).
- Gradients are summed over ranks, not averaged (divide factor 1): each rank's loss is its tokens' share of
  the global-batch mean (sum of its token losses / target tokens of the whole batch), so the sum is the
  one-process gradient for any number of ranks.
"""
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from livemoe.train.parallel.expert_parallel import ExpertParallel
from livemoe.train.parallel.mesh import ParallelMesh


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh) -> None:
    """Every SparseMoeBlock keeps experts [r * E/ep, (r+1) * E/ep) of EP rank r (the model must be the same
    on every rank before: built from one seed or loaded from one checkpoint)."""
    from livemoe.engine.model.layers import SparseMoeBlock  # here: livemoe.engine.model.layers imports livemoe.train.parallel (tensor parallel)

    size = mesh.dims.expert_parallel
    assert size > 1 and mesh.ep is not None, "expert parallel needs a mesh with expert_parallel > 1"
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        assert block.experts.expert_parallel is None, "expert parallel applied twice"
        ep = ExpertParallel(mesh.ep.get_group(), size, mesh.ep.get_local_rank(), block.experts.gate_up_proj.shape[0])
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(block.experts, name)
            local = nn.Parameter(full.detach()[ep.local_experts].clone(), requires_grad=full.requires_grad)
            setattr(block.experts, name, local)
        block.experts.expert_parallel = ep


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, *, param_dtype: torch.dtype = torch.bfloat16,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True) -> None:
    from livemoe.engine.model.layers import SparseMoeBlock

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        block = layer.mlp
        if isinstance(block, SparseMoeBlock) and block.experts.expert_parallel is not None:
            fully_shard(block.experts, mesh=mesh.dp_mod_ep, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(layer, mesh=mesh.dp, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh.dp, mp_policy=mp)  # root: embeddings, final norm, head
    register_fsdp_forward_method(model, "forward_hidden")  # what the trainers call instead of forward
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def parallelize(model: nn.Module, mesh: ParallelMesh, *, param_dtype: torch.dtype = torch.bfloat16,
                reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Expert parallel (when mesh.dims.expert_parallel > 1) then FSDP2, in place; a no-op in one process.
    Build the optimizer after this call: it must hold the sharded parameters."""
    if not mesh.distributed or isinstance(model, FSDPModule):  # (FSDPModule: parallelized on the meta device)
        return model
    num_experts = getattr(model.config, "num_experts", 0)
    mesh.dims.check_experts(num_experts)
    if mesh.dims.expert_parallel > 1:
        apply_expert_parallel(model, mesh)
    apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return model
