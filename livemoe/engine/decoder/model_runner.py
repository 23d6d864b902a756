"""ModelRunner: owns the KV cache, turns a scheduled step into tensors (slot_mapping, block tables,
context lens, cu_seqlens), runs the engine model with them and the cache's per-layer views as the step's
StepContext (an argument of the forward: nothing is attached to the shared module), and returns logits only
for the rows that sample. Decode steps replay CUDA graphs captured over a ladder of batch sizes; every
decode step that cannot (batch too large) runs eagerly and is counted and logged. With speculative decoding, a
step whose S sequences each have the same q new tokens (a verification: the last token and q - 1 drafts) replays
a graph of that (S, q), captured at its first use, for S up to the batch where speculation turns itself off and q
up to k + 1 (the paged prefill path over static cu_seqlens; its grid depends on S and q only).

Routed experts (SamplingParams.return_routed_experts): once enabled, every step stores each token's top-k
expert ids per MoE layer at its KV slot, in a buffer beside the KV cache ([slots, MoE layers, k], uint8 or
int16: 0.4% of Qwen3-30B-A3B's KV bytes per token). Kept per slot as the K/V are, a prefix-cache hit or a
recomputed (preempted) prefix has them too, and a finished sequence reads its own through its block table.
"""
import array
import functools
import logging
import math
from typing import Any

import torch

from livemoe.engine.decoder.config import EngineConfig
from livemoe.engine.decoder.host_inputs import HostInputs
from livemoe.engine.decoder.scheduler import SchedulerOutput
from livemoe.engine.decoder.step_plan import StepPlan
from livemoe.engine.decoder.weight_update import WeightUpdate, stage_update
from livemoe.engine.errors import EngineConfigError
from livemoe.engine.model.attention import Attention
from livemoe.engine.model.context import PlanCache, StepContext
from livemoe.engine.model.omni.thinker import MediaPiece, OmniThinkerForCausalLM
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM
from livemoe.engine.model.weights import Staged, stage_weights
from livemoe.engine.multimodal.encoder_cache import EncoderCache
from livemoe.engine.routed_experts import routed_dtype
from livemoe.kernels.batch_invariant import batch_invariant_mode
from livemoe.kernels._ext import sm_count
from livemoe.kernels.attention import choose_num_splits
from livemoe.kernels.moe import select_experts

log = logging.getLogger(__name__)
_ARRAY_TYPECODE = {torch.long: "q", torch.int32: "i"}
assert array.array("i").itemsize == 4 and array.array("q").itemsize == 8


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, config: EngineConfig, max_model_len: int):
        self.model = model
        self.config = config
        self.max_model_len = max_model_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = config.block_size
        backend = config.attention_backend  # auto: the kernels dispatch (flash-attn/Triton on CUDA, torch on CPU)
        if (backend == "triton" or (backend == "auto" and self.device.type == "cuda")) and self.block_size < 16:
            raise EngineConfigError(f"EngineConfig: the Triton attention kernels need block_size >= 16, "
                                    f"got {self.block_size}")
        self.backend = backend
        attn_layers = sorted((m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)
        assert attn_layers, "the model has no livemoe.engine.model.attention.Attention layers"
        # a layer reads its cache as step.kv_caches[layer_idx]
        assert [a.layer_idx for a in attn_layers] == list(range(len(attn_layers))), [a.layer_idx for a in attn_layers]
        self.num_layers = len(attn_layers)
        self.num_kv_heads, self.head_dim = attn_layers[0].num_kv_heads, attn_layers[0].head_dim
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.kv_cache: torch.Tensor | None = None
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per-layer (K, V) views of kv_cache
        self.num_blocks = 0
        self.use_cuda_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_vars: dict[str, torch.Tensor] = {}
        self.graph_pool: torch.cuda._POOL_HANDLE | None = None  # the graphs' shared memory pool
        self.num_eager_fallbacks = 0
        self.num_graph_replays = 0
        # speculative verification: graphs per (sequences, query tokens each), captured at first use
        self.verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.verify_vars: dict[str, torch.Tensor] = {}
        self.num_verify_graph_replays = 0
        # set for a step with prompt-logprob rows: execute() keeps every row's hidden state for the core to read
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.capture_routing = False  # enable_routing_capture(): store routed experts per KV slot
        self.routing: torch.Tensor | None = None  # [num_blocks * block_size, MoE layers, k], made at first use
        self.multimodal = model.config.omni is not None  # an Omni thinker: media in its steps
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes)  # media encoder outputs
        self.receiver: Any = None  # this rank's end of a trainer's weight-update group (join_weight_group)
        self.plan_cache = PlanCache()  # the fused CPU step's plan of self.model, kept while it holds
        self.host_inputs = HostInputs() if self.device.type == "cpu" else None  # step inputs, kept buffers

    # -- weights ------------------------------------------------------------------------------------

    def join_weight_group(self, **group) -> None:
        """Joins a trainer's weight-update group (livemoe.engine.core.weight_sync.WeightReceiver's arguments)."""
        from livemoe.engine.core.weight_sync import WeightReceiver  # torch.distributed: only for this

        self.receiver = WeightReceiver(**group)

    def stage_weights(self, update: WeightUpdate, tensors: list | None = None) -> Staged:
        if tensors is not None:  # the caller's pairs, in this process
            return stage_weights(self.model, tensors, update.where)
        return stage_update(self.model, update, self.receiver, self.device)

    def load_weights(self, update: WeightUpdate, tensors: list | None = None, refusal: str | None = None) -> int:
        """Stages the update, then applies it (the number of tensors), or raises RuntimeError(refusal) once it
        is staged (a broadcast is received whole even when the engine refuses it)."""
        staged = self.stage_weights(update, tensors)
        if refusal is not None:
            raise RuntimeError(refusal)
        return staged.apply()

    # -- KV cache -----------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """K and V of one block across all layers."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def budget_num_blocks(self, extra_block_bytes: int = 0) -> int:
        """Blocks the budget holds; extra_block_bytes: what each block costs besides this model's K and V (a draft
        model's cache, indexed by the same blocks)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.block_bytes + extra_block_bytes
        if self.device.type == "cuda":
            num = self._profile_gpu_blocks(per_block)
            budget = "gpu_memory_utilization"
        else:
            num = cfg.kv_cache_bytes // per_block
            budget = "kv_cache_bytes"
        if num < 1:
            raise EngineConfigError(f"EngineConfig: {budget} leaves no room for one KV block "
                                    f"({per_block} bytes)")
        return int(num)

    @torch.inference_mode()
    def _profile_gpu_blocks(self, per_block: int) -> int:
        """Free memory after a warm-up forward of a full token budget, as a fraction of the device."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
        hidden = self.model.forward_hidden(ids)
        self.model.compute_logits(hidden[0, : self.config.max_num_seqs])
        del hidden
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        activations = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        available = total * self.config.gpu_memory_utilization - used - activations
        return int(available // per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        assert self.kv_cache is None, "KV cache already allocated"
        shape = (2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks
        self.layer_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(self.num_layers)]
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                 self.kv_cache.numel() * self.dtype.itemsize / 2**20)

    def free_kv_cache(self) -> None:
        self.kv_cache = None
        self.routing = None
        self.layer_caches = []
        self.num_blocks = 0
        self._drop_graphs()  # they hold pointers into the freed cache
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- a step -------------------------------------------------------------------------------------

    def plan(self, out: SchedulerOutput) -> StepPlan:
        """The step's inputs on the host, all the forward needs (what tensor-parallel workers receive)."""
        bs = self.block_size
        seqs = out.seqs
        is_decode = out.is_decode_only
        mrope = media = None
        if is_decode:  # the common step: one token per sequence (row i is seq i)
            positions = [seq.num_computed_tokens for seq in seqs]
            input_ids = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
            slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
            context_lens = [p + 1 for p in positions]
            if self.multimodal:  # past media, a token's rotary position is its index + the sequence's rope_delta
                positions = [p + seq.rope_delta for seq, p in zip(seqs, positions)]
            cu = list(range(len(seqs) + 1))
            # a row samples when its token is the sequence's last (not a 1-token prefill chunk)
            sample_rows = [i for i, (seq, n) in enumerate(zip(seqs, context_lens)) if n == len(seq.token_ids)]
            sampling_seqs = sample_rows
        else:
            input_ids, positions, slots, cu, context_lens, sample_rows, sampling_seqs = [], [], [], [0], [], [], []
            for i, (seq, n) in enumerate(zip(seqs, out.num_new_tokens)):
                start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                table = seq.block_table
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                if seq.media is not None or mrope is not None:
                    mrope, media = self._plan_media(seqs[:i + 1], out.num_new_tokens, cu, mrope, media)
                cu.append(cu[-1] + n)
                context_lens.append(end)
                if end == len(seq):  # the last token's row, after those of its drafts being verified (if any)
                    sample_rows.extend(range(cu[-1] - 1 - seq.num_draft_tokens, cu[-1]))
                    sampling_seqs.append(i)
        width = max(len(seq.block_table) for seq in seqs)
        ints = context_lens + cu
        for seq in seqs:
            ints += seq.block_table
            ints += [-1] * (width - len(seq.block_table))
        return StepPlan(longs=array.array("q", input_ids + positions + slots), ints=array.array("i", ints),
                        sample_rows=sample_rows, num_seqs=len(seqs), width=width,
                        max_seqlen_q=max(out.num_new_tokens), is_decode=is_decode,
                        max_context_len=max(context_lens), sampling_seqs=sampling_seqs,
                        mrope=None if mrope is None else array.array("q", [p for row in mrope for p in row]),
                        media=media)

    @staticmethod
    def _plan_media(seqs, num_new_tokens, cu, mrope, media):
        """The multimodal rotary rows and media pieces of a prefill step, brought up to the last of `seqs` (cu: the
        rows before it). Made at the first sequence with media; those before it get their text positions."""
        if mrope is None:
            mrope, media = [[], [], []], []
            for seq, n in zip(seqs[:-1], num_new_tokens):
                start = seq.num_computed_tokens
                for row in mrope:
                    row.extend(range(start + seq.rope_delta, start + n + seq.rope_delta))
        seq, n = seqs[-1], num_new_tokens[len(seqs) - 1]
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        if seq.media is None:
            for row in mrope:
                row.extend(range(start, end))
            return mrope, media
        for row, values in zip(mrope, seq.media.positions_of(start, end, seq.rope_delta).tolist()):
            row.extend(values)
        for placed in seq.media.overlapping(start, end):
            lo, hi = max(placed.offset, start), min(placed.end, end)
            media.append((cu[-1] + lo - start, placed, lo - placed.offset, hi - placed.offset))
        return mrope, media

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, StepContext, list[int], list[int]]:
        """(input_ids [N], positions [N], StepContext, the rows that sample (indices into N), the seqs they belong
        to (indices into out.seqs), in the same order)."""
        plan = self.plan(out)
        assert plan.sampling_seqs is not None  # plan() sets it (only a worker's received plan lacks it)
        return *self.step_inputs(plan), plan.sample_rows, plan.sampling_seqs

    def step_inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        """(input_ids [N], positions [N], StepContext) on the device."""
        if self.host_inputs is not None:  # the CPU: views of buffers kept across steps
            views = self.host_inputs.views(plan)
        else:  # one tensor per dtype (a host-to-device copy each); the step's tensors are views of them
            views = plan.split(self._to_device(plan.longs, torch.long), self._to_device(plan.ints, torch.int32))
        input_ids, positions, slot_mapping, context_lens, cu_seqlens_q, block_tables = views
        ctx = StepContext(kv_caches=self.layer_caches, slot_mapping=slot_mapping, context_lens=context_lens,
                          cu_seqlens_q=cu_seqlens_q, block_tables=block_tables, max_seqlen_q=plan.max_seqlen_q,
                          is_decode=plan.is_decode, backend=self.backend, max_context_len=plan.max_context_len,
                          plan_cache=self.plan_cache)
        return input_ids, positions, ctx

    def _to_device(self, data: array.array, dtype: torch.dtype) -> torch.Tensor:
        assert data.typecode == _ARRAY_TYPECODE[dtype], (data.typecode, dtype)
        # through an array: 3x faster than torch.tensor(list) (~40 us a step)
        host = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Runs one step; returns (logits [num_sample_rows, V] fp32, indices into out.seqs that sample). A sampling
        sequence has one row, or 1 + num_draft_tokens consecutive rows when it verifies speculative drafts."""
        plan = self.plan(out)
        assert plan.sampling_seqs is not None  # plan() sets it (only a worker's received plan lacks it)
        return self.execute(plan), plan.sampling_seqs

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """The forward of a planned step: logits [len(plan.sample_rows), V] fp32."""
        assert self.kv_cache is not None, "no KV cache: reserve_kv_cache() first"
        input_ids, positions, ctx = self.step_inputs(plan)
        sample_rows = plan.sample_rows
        if plan.mrope is not None:
            hidden = self._run_multimodal(input_ids, plan, ctx)
        elif ctx.is_decode and self.use_cuda_graphs:
            hidden = self._run_decode_graph(input_ids, positions, ctx)
        elif (shape := self.verify_graph_shape(plan)) is not None:
            hidden = self._run_verify_graph(shape, input_ids, positions, ctx)
        else:
            hidden = self._run_eager(input_ids, positions, ctx)
        if self.keep_hidden:
            self.last_hidden = hidden
        if len(sample_rows) < hidden.shape[0]:  # logits only for the rows that sample
            hidden = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.long, device=self.device))
        return self.model.compute_logits(hidden).float()

    def _run_eager(self, input_ids, positions, ctx: StepContext) -> torch.Tensor:
        if not self.capture_routing:
            return self.model.forward_hidden(input_ids[None], positions[None], step=ctx)[0]
        hidden, router_logits = self.model.forward_hidden(input_ids[None], positions[None], step=ctx,
                                                          return_router_logits=True)
        self._routing_buffer()[ctx.slot_mapping] = self._routed_ids(router_logits)
        return hidden[0]

    def _run_multimodal(self, input_ids, plan: StepPlan, ctx: StepContext) -> torch.Tensor:
        """A prefill step with media: each item's encoder output (cached, or encoded now, before the LM step) spliced
        over its placeholders, and the multimodal rotary positions."""
        model = self.model
        assert plan.mrope is not None and plan.media is not None and isinstance(model, OmniThinkerForCausalLM)
        positions = self._to_device(plan.mrope, torch.long).view(3, 1, -1)
        pieces = [MediaPiece(flat, self.encoder_cache.get(model, placed.item, self.device), lo, hi)
                  for flat, placed, lo, hi in plan.media]
        embeds, deepstack = model.media_inputs(input_ids[None], pieces)
        out = model.forward_hidden(input_ids[None], positions, step=ctx, inputs_embeds=embeds, deepstack=deepstack,
                                   return_router_logits=self.capture_routing)
        if not self.capture_routing:
            return out[0]
        hidden, router_logits = out
        self._routing_buffer()[ctx.slot_mapping] = self._routed_ids(router_logits)
        return hidden[0]

    # -- routed experts -----------------------------------------------------------------------------

    def routing_capture_refusal(self) -> str | None:
        """Why this runner cannot turn routing capture on now (None: it can)."""
        return None

    def enable_routing_capture(self) -> None:
        """From the next step on, store every token's routed experts (the decode graphs are recaptured with it)."""
        if self.model.num_moe_layers == 0:
            raise EngineConfigError("routed experts: the model is dense (no MoE layer)")
        if not self.capture_routing:
            self.capture_routing = True
            self._drop_graphs()

    def _routed_ids(self, router_logits) -> torch.Tensor:
        """Per MoE layer's router logits [N, E] -> [N, MoE layers, k], the experts the layer ran (its routing)."""
        cfg = self.model.config
        ids = torch.stack([select_experts(x, cfg.num_experts_per_tok) for x in router_logits], dim=1)
        return ids.to(routed_dtype(cfg.num_experts))

    def _routing_buffer(self) -> torch.Tensor:
        if self.routing is None:
            assert self.kv_cache is not None, "no KV cache"
            cfg = self.model.config
            self.routing = torch.zeros(self.num_blocks * self.block_size, self.model.num_moe_layers,
                                       cfg.num_experts_per_tok, dtype=routed_dtype(cfg.num_experts), device=self.device)
        return self.routing

    def routed_experts_of(self, token_ids_len: int, block_table: list[int]):
        """The routed experts of a sequence's first token_ids_len - 1 tokens (all it ran; the last sampled token
        never is) as a numpy [tokens, MoE layers, k] array, read through its block table."""
        bs = self.block_size
        slots = [block_table[p // bs] * bs + p % bs for p in range(token_ids_len - 1)]
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        return self._routing_buffer().index_select(0, index).cpu().numpy()

    # -- CUDA graphs (decode) -----------------------------------------------------------------------

    def graph_batch_sizes(self) -> list[int]:
        top = min(self.config.max_num_seqs, self.config.max_graph_batch_size)
        sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
        if sizes[-1] != top:
            sizes.append(top)
        return sizes

    def _graph_buffers(self, top: int) -> dict[str, torch.Tensor]:
        """The static tensors a decode graph reads and writes (rows past the batch are padding)."""
        dev = self.device
        return dict(
            input_ids=torch.zeros(top, dtype=torch.long, device=dev),
            positions=torch.zeros(top, dtype=torch.long, device=dev),
            slot_mapping=torch.full((top,), -1, dtype=torch.long, device=dev),
            context_lens=torch.zeros(top, dtype=torch.int32, device=dev),
            block_tables=torch.full((top, self.max_blocks_per_seq), -1, dtype=torch.int32, device=dev),
            hidden=torch.zeros(top, self.model.config.hidden_size, dtype=self.dtype, device=dev),
            **({"routed": self._routing_buffer()[:top].clone()} if self.capture_routing else {}),
        )

    def _graph_context(self, b: int) -> StepContext:
        """The step a decode graph of batch b captures: the static buffers' first b rows and the cache's
        layer views (the cache is allocated once and the graphs are dropped when it is freed)."""
        v = self.graph_vars
        num_splits = choose_num_splits(b, self.num_kv_heads, self.max_model_len, self.block_size,
                                       sm_count(self.device))
        return StepContext(kv_caches=self.layer_caches, slot_mapping=v["slot_mapping"][:b],
                           context_lens=v["context_lens"][:b], block_tables=v["block_tables"][:b], is_decode=True,
                           backend=self.backend, num_splits=num_splits)

    def _graph_forward(self, b: int) -> None:
        """What a decode graph of batch b holds: the forward over the static buffers' first b rows."""
        self._forward_rows(self.graph_vars, b, self._graph_context(b))

    def _forward_rows(self, v: dict[str, torch.Tensor], n: int, step: StepContext) -> None:
        """What a graph holds: the forward over the first n rows of its static buffers v."""
        out = self.model.forward_hidden(v["input_ids"][:n][None], v["positions"][:n][None], step=step,
                                        return_router_logits=self.capture_routing)
        if self.capture_routing:
            out, router_logits = out
            v["routed"][:n] = self._routed_ids(router_logits)
        v["hidden"][:n] = out[0]

    def _capture(self, forward) -> torch.cuda.CUDAGraph:
        """A graph of forward() in the runner's pool, after a warm-up run (the kernels compile outside it). An exact
        engine's graphs hold the exact mode's kernels, wherever the capture is called from."""
        with batch_invariant_mode(self.config.batch_invariant):
            forward()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.graph_pool):
                forward()
        if self.graph_pool is None:
            self.graph_pool = graph.pool()
        return graph

    def _drop_graphs(self) -> None:
        self.graphs.clear()
        self.graph_vars.clear()
        self.verify_graphs.clear()
        self.verify_vars.clear()
        self.graph_pool = None

    def _fill_graph_buffers(self, input_ids, positions, ctx: StepContext, size: int) -> None:
        """Copies a decode step of B <= size rows in; rows B..size become padding (slot -1: nothing
        stored; context 0: attention output 0)."""
        B = input_ids.shape[0]
        v = self.graph_vars
        v["input_ids"][:B] = input_ids
        v["positions"][:B] = positions
        v["slot_mapping"][:size].fill_(-1)
        v["slot_mapping"][:B] = ctx.slot_mapping
        v["context_lens"][:size].zero_()
        v["context_lens"][:B] = ctx.context_lens
        v["block_tables"][:B, :ctx.block_tables.shape[1]] = ctx.block_tables

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        assert self.kv_cache is not None and self.device.type == "cuda"
        sizes = self.graph_batch_sizes()
        self.graph_vars = self._graph_buffers(sizes[-1])
        for b in reversed(sizes):  # largest first, so the pool is sized once
            self.graphs[b] = self._capture(functools.partial(self._graph_forward, b))
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs for batch sizes %s", len(sizes), sizes)

    def _run_decode_graph(self, input_ids, positions, ctx: StepContext) -> torch.Tensor:
        B = input_ids.shape[0]
        if not self.graphs:
            self.capture_cuda_graphs()
        if B > max(self.graphs):
            self.num_eager_fallbacks += 1
            log.warning("decode batch %d exceeds the largest CUDA graph (%d): running eagerly "
                        "(eager fallbacks so far: %d)", B, max(self.graphs), self.num_eager_fallbacks)
            return self._run_eager(input_ids, positions, ctx)
        size = min(b for b in self.graphs if b >= B)
        self._fill_graph_buffers(input_ids, positions, ctx, size)
        self.graphs[size].replay()
        self.num_graph_replays += 1
        if self.capture_routing:  # outside the graph: the slots of the real rows (padding rows have none)
            self._routing_buffer()[ctx.slot_mapping] = self.graph_vars["routed"][:B]
        return self.graph_vars["hidden"][:B]

    # -- CUDA graphs (speculative verification) -----------------------------------------------------

    def verify_graph_limits(self) -> tuple[int, int] | None:
        """(most sequences, most query tokens each) of the uniform steps verification graphs serve; None: none (no
        speculation, or no CUDA graphs)."""
        spec = self.config.speculative
        if not self.use_cuda_graphs or spec is None:
            return None
        top = min(spec.disable_by_batch_size, self.config.max_num_seqs, self.config.max_graph_batch_size)
        return max(1, top), spec.num_speculative_tokens + 1

    def verify_graph_shape(self, plan: StepPlan) -> tuple[int, int] | None:
        """(S, q) where every one of the step's S sequences has q > 1 new tokens and a graph serves that shape."""
        limits = self.verify_graph_limits()
        if limits is None or plan.is_decode:
            return None
        S, q = plan.num_seqs, plan.max_seqlen_q
        if S > limits[0] or q > limits[1] or plan.num_tokens != S * q:
            return None
        return S, q

    def _verify_buffers(self, max_seqs: int, max_q: int) -> dict[str, torch.Tensor]:
        rows = max_seqs * max_q
        v = self._graph_buffers(rows)
        v["cu_seqlens_q"] = torch.zeros(max_seqs + 1, dtype=torch.int32, device=self.device)
        v["block_tables"].fill_(0)  # a capture's warm-up before any step reads block 0
        return v

    def _verify_graph_context(self, shape: tuple[int, int]) -> StepContext:
        """The step a verification graph of S sequences of q tokens captures: the static buffers' first rows."""
        S, q = shape
        v, N = self.verify_vars, S * q
        return StepContext(kv_caches=self.layer_caches, slot_mapping=v["slot_mapping"][:N],
                           context_lens=v["context_lens"][:S], block_tables=v["block_tables"][:S],
                           cu_seqlens_q=v["cu_seqlens_q"][:S + 1], max_seqlen_q=q, is_decode=False,
                           backend=self.backend, max_context_len=self.max_model_len)  # an upper bound

    def _fill_verify_buffers(self, input_ids, positions, ctx: StepContext) -> None:
        v, N, S = self.verify_vars, input_ids.shape[0], ctx.context_lens.shape[0]
        v["input_ids"][:N] = input_ids
        v["positions"][:N] = positions
        v["slot_mapping"][:N] = ctx.slot_mapping
        v["context_lens"][:S] = ctx.context_lens
        assert ctx.cu_seqlens_q is not None  # a prefill-path step has them
        v["cu_seqlens_q"][:S + 1] = ctx.cu_seqlens_q
        v["block_tables"][:S, :ctx.block_tables.shape[1]] = ctx.block_tables

    def _run_verify_graph(self, shape: tuple[int, int], input_ids, positions, ctx: StepContext) -> torch.Tensor:
        S, q = shape
        N = S * q
        if not self.verify_vars:
            limits = self.verify_graph_limits()
            assert limits is not None  # verify_graph_shape() found one
            self.verify_vars = self._verify_buffers(*limits)
        v = self.verify_vars
        if shape not in self.verify_graphs:
            # the warm-up runs (eagerly) on q-token contexts of the tables the buffers hold, storing nothing: the
            # slots of an earlier step would otherwise get this run's K/V
            v["slot_mapping"][:N].fill_(-1)
            v["cu_seqlens_q"][:S + 1] = torch.arange(0, N + 1, q, dtype=torch.int32, device=self.device)
            v["context_lens"][:S] = q
            self.verify_graphs[shape] = self._capture(
                functools.partial(self._forward_rows, v, N, self._verify_graph_context(shape)))
            log.info("captured a speculative verification CUDA graph for %d sequence(s) of %d tokens", S, q)
        self._fill_verify_buffers(input_ids, positions, ctx)
        self.verify_graphs[shape].replay()
        self.num_verify_graph_replays += 1
        if self.capture_routing:
            self._routing_buffer()[ctx.slot_mapping] = v["routed"][:N]
        return v["hidden"][:N]
