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

Disaggregated GRPO (`--rollout_gpus N`: rollout servers on GPUs of their own, `--rollout_url`): the trainer GPUs
hold no KV cache, and the gathered bf16 copy only when rank 0 evaluates it (`gathered`; with `sharded` the push
streams from the shards, one tensor at a time). The rollout GPUs are planned apart,
`--rollout_tensor_parallel T` ranks per replica (N / T replicas): each holds its tensor-parallel share of the bf16
weights (livemoe.engine.model.memory), a staged copy of that share while a weight update is applied (every rank
stages, then all apply), and the KV cache of its replica's share of the rollouts in flight. With
`--max_staleness S` (asynchronous GRPO) the rollouts of S steps are in flight while a step trains, so the fleet's
KV cache holds S steps' sequences, and the trainer keeps S steps of finished rollouts (token ids, behaviour
log-probs, routed experts) in host memory (`async_buffer_host`, not GPU memory). Colocated (`--rollout_gpus 0`)
with S > 0 the two phases overlap on the same GPUs: their peak is the sum, not the larger one.
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
    rollout_gpus: int = 0  # grpo: GPUs of the rollout servers (0: the rollouts run on the trainer GPUs)
    rollout_tensor_parallel: int = 1  # ranks per rollout replica
    rollout_gpu_mem_gb: float = 0.0  # per rollout GPU (0: gpu_mem_gb)
    max_staleness: int = 0  # steps of rollouts in flight while a step trains (asynchronous GRPO)

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
        if self.rollout_gpus < 0 or self.max_staleness < 0 or self.rollout_tensor_parallel < 1 or \
                self.rollout_gpu_mem_gb < 0:
            raise ValueError(f"--rollout_gpus {self.rollout_gpus}, --max_staleness {self.max_staleness} and "
                             f"--rollout_gpu_mem_gb {self.rollout_gpu_mem_gb} must be >= 0, "
                             f"--rollout_tensor_parallel {self.rollout_tensor_parallel} >= 1")
        if (self.rollout_gpus or self.max_staleness) and self.trainer != "grpo":
            raise ValueError("--rollout_gpus and --max_staleness plan GRPO's rollouts: pass --trainer grpo")
        if self.rollout_gpus:
            if self.rollout_gpus % self.rollout_tensor_parallel:
                raise ValueError(f"--rollout_gpus {self.rollout_gpus} do not split into replicas of "
                                 f"--rollout_tensor_parallel {self.rollout_tensor_parallel}")
            from livemoe.engine.model.tensor_parallel import check_tensor_parallel

            check_tensor_parallel(cfg, self.rollout_tensor_parallel, bool(cfg.num_experts)
                                  and self.rollout_tensor_parallel > 1)
        elif self.rollout_tensor_parallel != 1:
            raise ValueError("--rollout_tensor_parallel is the rollout servers' layout: it needs --rollout_gpus")
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
    steps_in_flight = max(1, run.max_staleness)  # steps of rollouts generated at once
    if run.trainer == "grpo":
        per_gpu["rollout_weights_bf16"] = BF16 * total_params if run.rollout_weights == "gathered" else 0
        kv_per_token = 2 * L * cfg.num_key_value_heads * cfg.head_dim  # k and v, every layer
        per_gpu["rollout_kv_cache_bf16"] = 0 if run.rollout_gpus else \
            BF16 * steps_in_flight * run.sequences_per_rank * run.seq_len * kv_per_token
        per_gpu["reference_model_bf16"] = BF16 * numel
    per_gpu["reserve"] = int(run.reserve_gb * GB)
    activations = "activations_checkpointing" if run.gradient_checkpointing else "activations_no_checkpointing"
    counted = [k for k in per_gpu if not k.startswith("activations_")] + [activations]
    phases = {"step": counted}
    if run.trainer == "grpo" and not (run.max_staleness and not run.rollout_gpus):
        # livemoe.train.grpo never holds both: the peak is the larger phase (unless async rollouts share the GPUs)
        phases = {"rollout": [k for k in counted if k not in ("gradients_fp32", "fsdp_gathered_bf16", activations)],
                  "update": [k for k in counted if k != "rollout_kv_cache_bf16"]}
    phase_bytes = {name: sum(per_gpu[k] for k in keys) for name, keys in phases.items()}
    total = max(phase_bytes.values())
    host = {}
    if run.max_staleness:
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(L))
        # per token: its id (int64), behaviour log-prob and version-tagged mask (fp32 each), routed experts (uint8)
        per_token = 8 + 4 + 4 + moe_layers * cfg.num_experts_per_tok
        host["async_buffer_host"] = run.max_staleness * run.sequences_per_rank * run.seq_len * per_token
    fleet = rollout_fleet(cfg, run, steps_in_flight) if run.rollout_gpus else None
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
        "host_bytes": host,
        "rollout_fleet": fleet,
        "fits": total <= run.gpu_mem_gb * GB and (fleet is None or fleet["fits"]),
    }


def rollout_fleet(cfg: ModelConfig, run: PlanConfig, steps_in_flight: int) -> dict:
    """One rollout GPU of the disaggregated layout: its replica's tensor-parallel share of the weights, the staged
    copy of that share during a weight update, and the KV cache of its replica's share of the rollouts in flight
    (prompt and completion within seq_len)."""
    from livemoe.engine.model.memory import serving_memory

    T = run.rollout_tensor_parallel
    replicas = run.rollout_gpus // T
    m = serving_memory(cfg, T, BF16)
    weights = int(round(m["weights_gb_per_gpu"] * GB))
    sequences = math.ceil(steps_in_flight * run.sequences_per_step / replicas)
    per_gpu = {"weights_bf16": weights, "weight_update_staging_bf16": weights,
               "kv_cache_bf16": sequences * run.seq_len * m["kv_bytes_per_token_per_gpu"],
               "reserve": int(run.reserve_gb * GB)}
    total = sum(per_gpu.values())
    mem = run.rollout_gpu_mem_gb or run.gpu_mem_gb
    return {"gpus": run.rollout_gpus, "replicas": replicas, "tensor_parallel": T,
            "sequences_in_flight_per_replica": sequences, "per_gpu_bytes": per_gpu, "total_bytes": total,
            "total_gb": round(total / GB, 2), "gpu_mem_gb": mem, "fits": total <= mem * GB}


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
    for key, value in report["host_bytes"].items():
        lines.append(f"{key:32}{value / GB:>10.2f}  (host memory per rank)")
    fleet = report["rollout_fleet"]
    if fleet:
        lines.append(f"per rollout GPU: {fleet['gpus']} GPUs, {fleet['replicas']} replica(s) of tensor parallel "
                     f"{fleet['tensor_parallel']}, {fleet['sequences_in_flight_per_replica']} sequences in flight per "
                     "replica")
        for key, value in fleet["per_gpu_bytes"].items():
            lines.append(f"{key:32}{value / GB:>10.2f}")
        verdict = "fits" if fleet["fits"] else "does NOT fit"
        lines.append(f"{'total':32}{fleet['total_gb']:>10.2f}  {verdict} in {fleet['gpu_mem_gb']} GB")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="livemoe plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help=f"checkpoint dir, config.json, or a preset: {', '.join(preset_names())}")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu_mem_gb", type=float, required=True)
    defaults = PlanConfig(gpus=1, gpu_mem_gb=1)
    for name in ("expert_parallel", "seq_len", "batch_size", "rollouts", "micro_batch_size", "rollout_gpus",
                 "rollout_tensor_parallel", "max_staleness"):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    p.add_argument("--reserve_gb", type=float, default=defaults.reserve_gb)
    p.add_argument("--rollout_gpu_mem_gb", type=float, default=defaults.rollout_gpu_mem_gb,
                   help="per rollout GPU (default: --gpu_mem_gb)")
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
