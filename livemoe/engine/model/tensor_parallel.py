"""Tensor (and expert) parallel decoding: what one rank of an N-rank model holds and the collectives its forward
runs (Megatron's layout, as vLLM serves it). Every rank sees the same tokens and ends each layer with the same
hidden states, so the scheduler and sampler need not know the model is split.

- attention: q/k/v column-parallel by heads (each rank its Hq/N query heads and the KV heads they read; with
  fewer KV heads than ranks each KV head is replicated on the N/Hkv ranks whose query heads use it), o_proj
  row-parallel + one all-reduce; per-head q/k norms unchanged.
- dense MLP: gate/up column-parallel, down row-parallel + one all-reduce.
- MoE, tensor parallel: every expert's intermediate dim split like a dense MLP, router replicated, fused_moe on
  the shard weights, one all-reduce. Expert parallel: each rank holds E/N whole experts, routing identical on
  every rank, each rank's experts run on the (token, slot) pairs routed to them, one all-reduce sums them.
- embedding and lm_head vocab-parallel (the vocab padded up to a multiple of N): the embedding all-reduces,
  the logits are all-gathered, so compute_logits gives the full vocab on every rank.

The collectives are plain torch.distributed ops on fixed shapes with no host sync, so a CUDA graph captures
them (NCCL). Inference only: the all-reduces have no backward. A layer's `shards` ({parameter name: Shard})
says which slice of the checkpoint tensor it holds; livemoe.engine.model.loader reads exactly those slices.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.linear import Linear
from livemoe.kernels.moe import fused_experts, fused_moe, route


@dataclass(frozen=True)
class Shard:
    """The part of a full (checkpoint) tensor a rank holds: `ranges` [start, end) along `dim`, concatenated."""
    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(end - start for start, end in self.ranges)


@dataclass
class TensorParallel:
    """This rank's place in the tensor-parallel group (all ranks of the model); expert_parallel: MoE layers
    hold whole experts (E/N each) instead of every expert's 1/N."""
    rank: int
    size: int
    group: dist.ProcessGroup | None
    expert_parallel: bool = False

    def __post_init__(self):
        assert 0 <= self.rank < self.size, (self.rank, self.size)

    def split(self, n: int, unit: int = 1) -> Shard:
        """This rank's even share of n items (n % size == 0), in elements of `unit` each, along dim 0."""
        assert n % self.size == 0, (n, self.size)
        per = n // self.size
        return Shard(0, ((self.rank * per * unit, (self.rank + 1) * per * unit),))

    def kv_heads(self, num_kv_heads: int, num_heads: int, unit: int = 1) -> Shard:
        """The KV heads this rank holds (in elements of `unit` each): the ones its query heads read, an even
        split, or one head replicated on N/Hkv ranks when Hkv < N (vLLM's rule)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, unit)
        first = self.rank * (num_heads // self.size) // (num_heads // num_kv_heads)
        return Shard(0, ((first * unit, (first + 1) * unit),))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def to_dict(self) -> dict:
        return {"tensor_parallel_size": self.size, "rank": self.rank, "expert_parallel": self.expert_parallel}


def check_tensor_parallel(cfg: ModelConfig, size: int, expert_parallel: bool) -> None:
    """ValueError naming the values unless the model splits evenly over `size` ranks (call before any process
    starts). The vocab needs no check: it is padded to a multiple of size."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's num_attention_heads={heads}")
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and the model's num_key_value_heads={kv}: one must divide "
                         "the other (KV heads are split over the ranks, or replicated when fewer than the ranks)")
    if expert_parallel and not cfg.num_experts:
        raise ValueError("enable_expert_parallel needs an MoE model; this one is dense (num_experts=0)")
    if cfg.num_experts and expert_parallel and cfg.num_experts % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's num_experts={cfg.num_experts} "
                         "(with expert parallel each rank holds num_experts / size whole experts)")
    if cfg.num_experts and not expert_parallel and cfg.moe_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's moe_intermediate_size="
                         f"{cfg.moe_intermediate_size} (without expert parallel every expert is split; "
                         "enable_expert_parallel splits whole experts instead)")
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if dense and cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's intermediate_size="
                         f"{cfg.intermediate_size} (of its dense MLP layers {dense})")


class ColumnParallelLinear(nn.Linear):
    """nn.Linear holding output rows `rows` of the full layer (and of its bias); no communication."""

    def __init__(self, in_features: int, rows: Shard, bias: bool):
        super().__init__(in_features, rows.size, bias=bias)
        self.shards = {"weight": rows, "bias": rows} if bias else {"weight": rows}


class RowParallelLinear(nn.Linear):
    """nn.Linear holding input columns `cols` of the full layer; the partial products are all-reduced, then the
    (replicated) bias is added once."""

    def __init__(self, cols: Shard, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(cols.size, out_features, bias=bias)
        self.shards = {"weight": Shard(1, cols.ranges)}
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, Shard]:
    """(rows per rank, the checkpoint rows this rank holds): the vocab padded up to a multiple of N, the last
    rank's padding rows zero."""
    per = -(-vocab_size // tp.size)
    start = tp.rank * per
    return per, Shard(0, ((min(start, vocab_size), min(start + per, vocab_size)),))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [rank * V/N, (rank + 1) * V/N) of the embedding; a token outside them embeds to zero here, and the
    all-reduce gives every rank every token's row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        per, rows = vocab_shard(vocab_size, tp)
        super().__init__(per, hidden_size)
        self.shards = {"weight": rows}
        self.vocab_start, self.tp = tp.rank * per, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[..., None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Linear):
    """The output projection's vocab rows of this rank (padded like VocabParallelEmbedding)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel):
        per, rows = vocab_shard(vocab_size, tp)
        super().__init__(hidden_size, per, bias=False)
        self.shards = {"weight": rows}


# torch >= 2.13 names it all_gather_single (the old name warns); the same collective
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_logits(local: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """[..., V/N] logits of this rank's vocab rows -> [..., V] on every rank."""
    local = local.contiguous()
    out = local.new_empty((tp.size * local.shape[0],) + tuple(local.shape[1:]))  # ranks' blocks stacked on dim 0
    _all_gather_single(out, local, group=tp.group)
    return out.view((tp.size,) + tuple(local.shape)).movedim(0, -2).flatten(-2)[..., :vocab_size]


def column_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None,
                  rows: Shard | None = None) -> nn.Linear:
    """nn.Linear in one process; else this rank's rows (`rows`, default an even split of out_features)."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, rows or tp.split(out_features), bias)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None,
               cols: Shard | None = None) -> nn.Linear:
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(cols or tp.split(in_features), out_features, bias, tp)


class TensorParallelExperts:
    """Every expert's intermediate dim split over the ranks (gate_up_proj [E, 2I/N, H]: this rank's gate rows,
    then its up rows; down_proj [E, H, I/N]): fused_moe on the shards gives partial sums, one all-reduce."""

    def __init__(self, tp: TensorParallel, num_experts: int, intermediate_size: int):
        rows = tp.split(intermediate_size).ranges[0]
        self.shards = {"gate_up_proj": Shard(1, (rows, (intermediate_size + rows[0], intermediate_size + rows[1]))),
                       "down_proj": Shard(2, (rows,))}
        self.local_shape = (num_experts, intermediate_size // tp.size)  # (experts, intermediate) held
        self.tp = tp

    def fused_moe(self, hidden_states, w_gate_up, w_down, router_logits, top_k: int, renormalize: bool):
        """livemoe.kernels.moe.fused_moe's signature (what livemoe.engine.model.layers.Experts calls)."""
        return self.tp.all_reduce(fused_moe(hidden_states, w_gate_up, w_down, router_logits, top_k, renormalize))


class ReplicatedExpertParallel:
    """Expert parallel over replicated tokens (decode: every rank has every token): rank r holds experts
    [r * E/N, (r + 1) * E/N) whole; every rank routes all tokens (same logits, same top-k), runs its experts on
    the (token, slot) pairs routed to them and the all-reduce sums the N partial outputs. At decode batch sizes
    this beats an all-to-all dispatch/combine of 1/N of the tokens per rank (bench/bench_ep_decode.py)."""

    def __init__(self, tp: TensorParallel, num_experts: int, intermediate_size: int):
        per = num_experts // tp.size
        self.first, self.num_local = tp.rank * per, per
        self.shards = {"gate_up_proj": Shard(0, ((self.first, self.first + per),)),
                       "down_proj": Shard(0, ((self.first, self.first + per),))}
        self.local_shape = (per, intermediate_size)
        self.tp = tp

    def fused_moe(self, hidden_states, w_gate_up, w_down, router_logits, top_k: int, renormalize: bool,
                  fixed_shapes: bool | None = None):
        """livemoe.kernels.moe.fused_moe's signature. fixed_shapes (default: while a CUDA graph is captured): no host
        sync, the pairs routed elsewhere go through local expert 0 with weight 0; otherwise only this rank's
        pairs are gathered and computed (a prefill of T tokens does 1/N of the expert work, not all of it)."""
        topk_weights, topk_ids = route(router_logits, top_k, renormalize)
        local_ids = topk_ids - self.first
        mine = (local_ids >= 0) & (local_ids < self.num_local)
        if fixed_shapes is None:
            fixed_shapes = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
        if fixed_shapes:
            out = fused_experts(hidden_states, w_gate_up, w_down, topk_weights.masked_fill(~mine, 0),
                                local_ids.masked_fill(~mine, 0))
        else:
            tokens, slots = mine.nonzero(as_tuple=True)
            pairs = fused_experts(hidden_states[tokens], w_gate_up, w_down, topk_weights[tokens, slots, None],
                                  local_ids[tokens, slots, None])
            out = torch.zeros_like(hidden_states).index_add_(0, tokens, pairs)
        return self.tp.all_reduce(out)


def parallel_experts(tp: TensorParallel, num_experts: int, intermediate_size: int):
    """The experts' layout on this rank: whole experts with expert parallel, every expert split without."""
    layout = ReplicatedExpertParallel if tp.expert_parallel else TensorParallelExperts
    return layout(tp, num_experts, intermediate_size)
