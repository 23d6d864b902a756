"""Memory planner: what one GPU holds when a model trains with FSDP2 + expert parallel, and whether it fits.

    livemoe plan --model qwen3-30b-a3b --gpus 8 --gpu_mem_gb 141 --expert_parallel 8 --trainer grpo

The layout is livemoe.train.parallel's: bf16 compute, fp32 master parameters, fp32 gradients and fp32 AdamW states
(exp_avg, exp_avg_sq, step), all sharded. FSDP2 shards each tensor on dim 0 over its mesh: the dense tensors
over all `gpus` ranks, the expert tensors (their EP rank's E/ep experts) over the gpus/ep ranks that hold the
same experts; a rank holds ceil(rows / ranks) rows (rank 0, the fullest rank, is the one reported). These
three figures are exact (tests compare them with what a CPU run allocates); the parameter shapes come from
the engine's own model, built on the meta device.

Estimates, stated as such: the bf16 working set FSDP gathers (the root unit of embeddings, final norm and
head, held through forward and backward; two decoder layers, the one computing and the one prefetched; one
layer's unsharded gradient in bf16 and its fp32 reduce-scatter input); activations saved for backward per
micro-batch (with and without gradient checkpointing, which keeps each layer's input and recomputes one layer
at a time); for GRPO, whose peak is the larger of its two phases (rollouts: no gradients, no FSDP working set
or activations; the update: no KV cache, which the trainer releases), the rollout engine's weights (`gathered`: a full bf16 inference copy refreshed after each
step, as verl's hybrid engine; `sharded`: generation through the FSDP module, nothing extra), its KV cache for
the rank's rollouts at seq_len, and the frozen reference model (bf16, sharded like the policy); and a fixed
reserve for the CUDA context and allocator fragmentation. GB = 1e9 bytes.
"""
import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass


from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.flops import preset_names, resolve_config
from livemoe.engine.model.memory import is_expert_param, param_shapes  # shared with the serving planner

GB = 1e9
TRAINERS = ("rft", "grpo")
ROLLOUT_WEIGHTS = ("gathered", "sharded")
FP32, BF16 = 4, 2


@dataclass(kw_only=True)
class PlanConfig:
    """The run being planned, validated in one place (ValueError naming the values)."""
    gpus: int
    gpu_mem_gb: float
    expert_parallel: int = 1
    trainer: str = "rft"
    seq_len: int = 2048
    batch_size: int = 64  # sequences per optimizer step (grpo: prompts), global
    rollouts: int = 8  # grpo: completions per prompt (the seed's 8)
    micro_batch_size: int = 1  # sequences per forward/backward on one rank
    gradient_checkpointing: bool = True
    rollout_weights: str = "gathered"
    reserve_gb: float = 4.0

    def validate(self, cfg: ModelConfig) -> None:
        for name in ("gpus", "expert_parallel", "seq_len", "batch_size", "rollouts", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.gpu_mem_gb <= 0 or self.reserve_gb < 0:
            raise ValueError(f"--gpu_mem_gb must be > 0 and --reserve_gb >= 0, got {self.gpu_mem_gb}, "
                             f"{self.reserve_gb}")
        if self.trainer not in TRAINERS:
            raise ValueError(f"--trainer must be one of {TRAINERS}, got {self.trainer!r}")
        if self.rollout_weights not in ROLLOUT_WEIGHTS:
            raise ValueError(f"--rollout_weights must be one of {ROLLOUT_WEIGHTS}, got {self.rollout_weights!r}")
        from livemoe.train.parallel import ParallelDims

        ParallelDims(world_size=self.gpus, expert_parallel=self.expert_parallel).check_experts(cfg.num_experts)
        if self.sequences_per_step % self.gpus:
            raise ValueError(f"the global batch of {self.sequences_per_step} sequences does not split over "
                             f"--gpus {self.gpus}")
        if self.sequences_per_rank % self.micro_batch_size:
            raise ValueError(f"{self.sequences_per_rank} sequences per rank do not split into micro-batches of "
                             f"--micro_batch_size {self.micro_batch_size}")

    @property
    def sequences_per_step(self) -> int:
        return self.batch_size * (self.rollouts if self.trainer == "grpo" else 1)

    @property
    def sequences_per_rank(self) -> int:
        return self.sequences_per_step // self.gpus


def local_shape(name: str, shape: tuple[int, ...], gpus: int, expert_parallel: int) -> tuple[int, ...]:
    """The shape rank 0 holds: experts split over EP first (whole experts), then every tensor's dim 0 over
    its FSDP mesh in ceil(rows / ranks) rows (FSDP2's chunking)."""
    if is_expert_param(name):
        rows, ranks = shape[0] // expert_parallel, gpus // expert_parallel
    else:
        rows, ranks = shape[0], gpus
    return (min(rows, math.ceil(rows / ranks)),) + shape[1:]


def sharded_numel(shapes, gpus: int, expert_parallel: int, which=lambda name: True) -> tuple[int, int]:
    """(elements rank 0 holds, number of tensors) over the parameters `which` selects."""
    numel = tensors = 0
    for name, shape in shapes:
        if which(name):
            numel += math.prod(local_shape(name, shape, gpus, expert_parallel))
            tensors += 1
    return numel, tensors


def layer_numel(shapes, layer: int, expert_parallel: int) -> int:
    """Elements of one decoder layer as its FSDP unit gathers them (experts: the EP rank's share)."""
    prefix = f"model.layers.{layer}."
    return sum(math.prod(s) // (expert_parallel if is_expert_param(n) else 1) for n, s in shapes
               if n.startswith(prefix))


def activation_elements_per_token(cfg: ModelConfig, layer: int) -> int:
    """bf16-element equivalents one token saves for backward in one decoder layer (fp32 tensors count 2)."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    attention = 2 * H + (q + kv) + (q + 2 * kv) + q + 2 * cfg.num_attention_heads  # norm in, proj in, pre-qk-norm,
    # rope'd q/k and v, attention out, log-sum-exp (fp32)
    if cfg.is_moe_layer(layer):
        k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        # norm in, normed x, router logits and probs (fp32), per routed pair: the token row it carries, the
        # expert's gate/up pre-activations and its output (kept for the routing weight's gradient)
        mlp = 2 * H + 4 * cfg.num_experts + k * (2 * H + 2 * inter)
    else:
        mlp = 2 * H + 3 * cfg.intermediate_size
    return attention + mlp


def plan(cfg: ModelConfig, run: PlanConfig) -> dict:
    run.validate(cfg)
    shapes = param_shapes(cfg)
    W, ep = run.gpus, run.expert_parallel
    numel, tensors = sharded_numel(shapes, W, ep)
    expert_numel, _ = sharded_numel(shapes, W, ep, is_expert_param)
    total_params = sum(math.prod(s) for _, s in shapes)
    expert_params = sum(math.prod(s) for n, s in shapes if is_expert_param(n))
    L = cfg.num_hidden_layers
    root = sum(math.prod(s) for n, s in shapes if not n.startswith("model.layers."))
    biggest_layer = max(layer_numel(shapes, i, ep) for i in range(L))
    tokens = run.micro_batch_size * run.seq_len
    per_layer = [activation_elements_per_token(cfg, i) for i in range(L)]
    final = 2 * cfg.hidden_size  # final norm in and out (the fused log-prob kernel never holds [T, V] logits)

    per_gpu = {
        "parameters_fp32": FP32 * numel,
        "gradients_fp32": FP32 * numel,
        "optimizer_adamw_fp32": 2 * FP32 * numel + FP32 * tensors,  # exp_avg, exp_avg_sq, and a step per tensor
        "fsdp_gathered_bf16": BF16 * (root + 2 * biggest_layer) + (BF16 + FP32) * biggest_layer,
        "activations_no_checkpointing": BF16 * tokens * (sum(per_layer) + final),
        "activations_checkpointing": BF16 * tokens * (L * cfg.hidden_size + max(per_layer) + final),
    }
    if run.trainer == "grpo":
        per_gpu["rollout_weights_bf16"] = BF16 * total_params if run.rollout_weights == "gathered" else 0
        kv_per_token = 2 * L * cfg.num_key_value_heads * cfg.head_dim  # k and v, every layer
        per_gpu["rollout_kv_cache_bf16"] = BF16 * run.sequences_per_rank * run.seq_len * kv_per_token
        per_gpu["reference_model_bf16"] = BF16 * numel
    per_gpu["reserve"] = int(run.reserve_gb * GB)
    activations = "activations_checkpointing" if run.gradient_checkpointing else "activations_no_checkpointing"
    counted = [k for k in per_gpu if not k.startswith("activations_")] + [activations]
    phases = {"step": counted}
    if run.trainer == "grpo":  # livemoe.train.grpo never holds both: the peak is the larger phase
        phases = {"rollout": [k for k in counted if k not in ("gradients_fp32", "fsdp_gathered_bf16", activations)],
                  "update": [k for k in counted if k != "rollout_kv_cache_bf16"]}
    phase_bytes = {name: sum(per_gpu[k] for k in keys) for name, keys in phases.items()}
    total = max(phase_bytes.values())
    return {
        "model": {"params_total": total_params, "params_experts": expert_params, "num_experts": cfg.num_experts,
                  "layers": L},
        "run": asdict(run) | {"sequences_per_step": run.sequences_per_step,
                              "sequences_per_rank": run.sequences_per_rank,
                              "grad_accum": run.sequences_per_rank // run.micro_batch_size},
        "per_gpu_params": {"total": numel, "experts": expert_numel, "tensors": tensors},
        "per_gpu_bytes": per_gpu,
        "counted": counted,
        "phases": phases,
        "phase_bytes": phase_bytes,
        "total_bytes": total,
        "total_gb": round(total / GB, 2),
        "gpu_mem_gb": run.gpu_mem_gb,
        "fits": total <= run.gpu_mem_gb * GB,
    }


def format_table(report: dict) -> str:
    run = report["run"]
    lines = [f"per GPU: {run['gpus']} GPUs x {run['gpu_mem_gb']} GB, expert_parallel {run['expert_parallel']}, "
             f"{run['trainer']}, seq_len {run['seq_len']}, {run['sequences_per_rank']} sequences per rank per step "
             f"(micro-batch {run['micro_batch_size']}, grad_accum {run['grad_accum']})",
             f"{'':32}{'GB':>10}  counted"]
    for key, value in report["per_gpu_bytes"].items():
        lines.append(f"{key:32}{value / GB:>10.2f}  {'yes' if key in report['counted'] else ''}")
    verdict = "fits" if report["fits"] else "does NOT fit"
    if len(report["phases"]) > 1:
        lines.append("phases (the peak is the larger): " + ", ".join(
            f"{name} {b / GB:.2f}" for name, b in report["phase_bytes"].items()))
    lines.append(f"{'total':32}{report['total_gb']:>10.2f}  {verdict} in {report['gpu_mem_gb']} GB")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="livemoe plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help=f"checkpoint dir, config.json, or a preset: {', '.join(preset_names())}")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu_mem_gb", type=float, required=True)
    defaults = PlanConfig(gpus=1, gpu_mem_gb=1)
    for name in ("expert_parallel", "seq_len", "batch_size", "rollouts", "micro_batch_size"):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    p.add_argument("--reserve_gb", type=float, default=defaults.reserve_gb)
    p.add_argument("--trainer", default=defaults.trainer, help=" | ".join(TRAINERS))
    p.add_argument("--rollout_weights", default=defaults.rollout_weights, help=" | ".join(ROLLOUT_WEIGHTS))
    p.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction,
                   default=defaults.gradient_checkpointing)
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    args = vars(p.parse_args(argv))
    as_json = args.pop("json")
    try:
        cfg = resolve_config(args.pop("model"))
        report = plan(cfg, PlanConfig(**args))
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if as_json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
