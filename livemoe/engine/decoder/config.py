"""EngineConfig: the decoder's options, typed and validated in one place (EngineConfigError, a ValueError).

KV-cache size: `num_kv_blocks` when given; else on a GPU `gpu_memory_utilization` of the device's memory
minus what the weights and a warm-up forward of `max_num_batched_tokens` tokens use; else (CPU)
`kv_cache_bytes`. With tensor_parallel_size > 1 every rank holds a cache of that many blocks (the
smallest any rank can hold), of its own heads.
"""
from dataclasses import dataclass, fields

from livemoe.engine.checks import check_positive_ints
from livemoe.engine.decoder.spec.config import SpeculativeConfig
from livemoe.engine.errors import EngineConfigError, RequestError

ATTENTION_BACKENDS = ("auto", "triton", "reference")
DEFAULT_THREADS = 1  # CPU decode of small models: 0.8-1.2 ms/step with 1 thread, 7-30 with 2 (shared 2-core host)


@dataclass(kw_only=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block (a power of two; >= 16 for the Triton kernels)
    max_num_seqs: int = 256  # sequences in flight
    max_num_batched_tokens: int = 8192  # tokens computed per step (prefill chunks + decodes)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # exact KV-cache size in blocks (overrides the budgets below)
    kv_cache_bytes: int = 256 * 2**20  # CPU budget for K and V of all layers
    gpu_memory_utilization: float = 0.9  # fraction of the GPU's memory the whole process may use
    enforce_eager: bool = False  # no CUDA graphs
    max_graph_batch_size: int = 256  # largest decode batch captured in a CUDA graph
    attention_backend: str = "auto"  # auto: Triton on CUDA, csrc/paged_attention.cpp on CPU; "reference": PyTorch
    seed: int = 0  # the generator of requests that give no seed
    # a request's running sequences beyond this yield their seats to other requests' waiting ones (preempted,
    # recomputed later), so a request with a large n cannot starve a small one; alone, a request uses every seat
    max_running_seqs_per_request: int = 32
    # torch CPU threads (0: torch's default). None: 1 for an engine that loads its checkpoint (measured fastest
    # for CPU decode of small models on a shared 2-core machine; the trainers' default too), and the caller's
    # setting for LLM.from_model (a trainer sets its own). Raise it on a dedicated many-core host
    threads: int | None = None
    use_tqdm: bool = True  # progress bar in generate() for batches of more than 16 prompts
    # ranks one model is split over (livemoe/engine/decoder/workers.py): one process per GPU, this one is rank 0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE layers: each rank holds num_experts / tensor_parallel_size experts
    # livemoe.engine.decoder.spec: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...} (a dict or
    # its JSON; parsed into a SpeculativeConfig here)
    speculative_config: str | dict | SpeculativeConfig | None = None
    # media (a Qwen3-Omni-MoE thinker; livemoe.engine.multimodal): per-item limits, video sampling, encoder cache
    max_audio_seconds: float = 300.0
    max_image_pixels: int = 1280 * 32 * 32  # larger images are scaled down to this many pixels
    video_fps: float = 2.0  # frames sampled per second of an animated image
    max_video_frames: int = 128
    max_video_pixels: int = 256 * 32 * 32  # per frame
    encoder_cache_bytes: int = 256 * 2**20  # encoder outputs kept for reuse (LRU)
    # exact mode (livemoe.kernels.batch_invariant): every forward op batch-invariant, so a token's log-probs have
    # the same bits in any batch, prefill chunk or cache hit, and equal a trainer's forward in that mode on the same
    # kind of device (C++ kernels on the CPU, Triton on CUDA)
    batch_invariant: bool = False

    def __post_init__(self):
        def fail(msg):
            raise EngineConfigError(f"EngineConfig: {msg}")

        check_positive_ints(self, ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes",
                                   "max_graph_batch_size", "max_running_seqs_per_request", "tensor_parallel_size",
                                   "max_image_pixels", "max_video_frames", "max_video_pixels"), fail)
        for name in ("max_audio_seconds", "video_fps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                fail(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.encoder_cache_bytes, int) or self.encoder_cache_bytes < 0:
            fail(f"encoder_cache_bytes must be an integer >= 0, got {self.encoder_cache_bytes!r}")
        check_positive_ints(self, [n for n in ("max_model_len", "num_kv_blocks") if getattr(self, n) is not None],
                            fail)
        if self.block_size & (self.block_size - 1):
            fail(f"block_size must be a power of two, got {self.block_size}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            fail(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or self.threads < 0):
            fail(f"threads must be an integer >= 0 (0: torch's default), got {self.threads!r}")
        if not isinstance(self.seed, int):
            fail(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            fail(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        if not isinstance(self.batch_invariant, bool):
            fail(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.batch_invariant and self.attention_backend != "auto":
            fail(f"batch_invariant attends with its own kernel (the same per-query walk as the trainer's): "
                 f"attention_backend={self.attention_backend!r} would not be used; leave it at 'auto'")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            fail("batch_invariant runs in one process: its kernels have no tensor-parallel split (a sharded "
                 "matmul's all-reduce adds in another order); use tensor_parallel_size=1")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            fail("enable_expert_parallel needs tensor_parallel_size > 1 (it splits the experts over those ranks)")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        assert not isinstance(self.speculative_config, (str, dict))  # parsed in __post_init__
        return self.speculative_config

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise EngineConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


def resolve_max_model_len(config: EngineConfig, mc) -> int:
    """The context the engine serves: max_model_len, at most the model's max_position_embeddings."""
    limit = mc.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise RequestError(f"max_model_len {config.max_model_len} exceeds the model's "
                           f"max_position_embeddings {limit}")
    return config.max_model_len or limit


def apply_threads(threads: int) -> None:
    """torch's CPU thread count for the engine (0: leave it). Process-wide; the in-thread engine's loop calls
    it again (OpenMP settings are per thread until a thread's first parallel region)."""
    if threads:
        import torch  # here: reading the config (a server's --help) needs no torch

        torch.set_num_threads(threads)
