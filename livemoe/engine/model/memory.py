"""What one GPU holds when a model is served with tensor parallel (and expert parallel) over N GPUs:
the weights of its rank and the KV cache per token.

    python -m livemoe.engine.model.memory --model qwen3-235b-a22b --tensor-parallel-size 8 [--enable-expert-parallel]

The layout is vLLM's, which the engine's tensor-parallel model follows: q/k/v column-parallel by heads (the
KV heads split, or each rank holding one when there are fewer KV heads than ranks), o_proj row-parallel;
dense MLPs column/row-parallel; the experts either tensor-parallel (every expert's intermediate split) or,
with expert parallel, E/N whole experts per rank (the same bytes either way); embeddings and lm_head
vocab-parallel; norms and the router replicated. The parameter shapes come from the engine's own model on
the meta device (livemoe.train.plan counts the trainers' memory from the same list). GB = 1e9 bytes.
"""
import argparse
import math
import sys

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.flops import preset_names, resolve_config
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM

GB = 1e9
REPLICATED = ("norm.weight", "mlp.gate.weight")  # every rank holds these whole


def param_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every parameter of the engine's model (a tied embedding once)."""
    import torch

    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def kv_heads_per_rank(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """KV heads are split over the ranks, or replicated (one per rank) when there are fewer than ranks."""
    return max(1, cfg.num_key_value_heads // tensor_parallel_size)


def rank_numel(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """Parameter elements rank 0 holds (the fullest rank: ceil where a dimension does not divide)."""
    n = tensor_parallel_size
    total = 0
    for name, shape in param_shapes(cfg):
        numel = math.prod(shape)
        if name.endswith(REPLICATED):
            total += numel
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            total += kv_heads_per_rank(cfg, n) * cfg.head_dim * shape[1]
        else:  # split on one dimension: rows (column-parallel, vocab, experts) or columns (row-parallel)
            total += math.ceil(numel / n)
    return total


def serving_memory(cfg: ModelConfig, tensor_parallel_size: int, dtype_bytes: int = 2) -> dict:
    """Per GPU: weights (GB), KV cache bytes per token (K and V of every layer, this rank's heads), and the
    model's whole weights (GB) for comparison."""
    total = sum(math.prod(s) for _, s in param_shapes(cfg))
    kv = 2 * cfg.num_hidden_layers * kv_heads_per_rank(cfg, tensor_parallel_size) * cfg.head_dim * dtype_bytes
    return {"tensor_parallel_size": tensor_parallel_size, "weights_gb_per_gpu": rank_numel(cfg, tensor_parallel_size)
            * dtype_bytes / GB, "model_weights_gb": total * dtype_bytes / GB, "kv_bytes_per_token_per_gpu": kv}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livemoe.engine.model.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=f"a checkpoint directory, config.json or preset ({', '.join(preset_names())})")
    p.add_argument("--tensor-parallel-size", type=int, required=True)
    p.add_argument("--enable-expert-parallel", action="store_true", help="(the same bytes per GPU: whole experts)")
    p.add_argument("--gpu-mem-gb", type=float, default=141.0, help="per GPU (default: an H200's 141)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="the engine option (default 0.9)")
    args = p.parse_args(argv)
    try:
        cfg = resolve_config(args.model)
        if args.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
        m = serving_memory(cfg, args.tensor_parallel_size)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"livemoe.engine.model.memory: {e}")
    left = args.gpu_mem_gb * args.gpu_memory_utilization - m["weights_gb_per_gpu"]
    print(f"model weights (bf16)          {m['model_weights_gb']:8.1f} GB")
    print(f"weights per GPU (TP {args.tensor_parallel_size})        {m['weights_gb_per_gpu']:8.1f} GB")
    print(f"KV cache per token per GPU    {m['kv_bytes_per_token_per_gpu'] / 1024:8.1f} KiB")
    if left > 0:
        tokens = int(left * GB // m["kv_bytes_per_token_per_gpu"])
        print(f"KV cache room at {args.gpu_memory_utilization:.0%} of {args.gpu_mem_gb:.0f} GB  {left:8.1f} GB = "
              f"{tokens:,} tokens (less activations and CUDA graphs)")
    else:
        print(f"does not fit: the weights alone exceed {args.gpu_memory_utilization:.0%} of {args.gpu_mem_gb:.0f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
