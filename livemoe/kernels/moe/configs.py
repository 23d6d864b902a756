"""Block sizes for the MoE grouped GEMMs: a default heuristic, and tuned configs saved per GPU name.

`get_config(...)` returns, in order: a tuned config from the JSON cache for this GPU and shape bucket,
else the heuristic (so an untuned GPU always works). `tune(...)` times candidate configs on the GPU
and saves the winner (`python -m livemoe.kernels.moe.tune` does it for a model's shapes);
`LIVEMOE_MOE_AUTOTUNE=1` makes `fused_moe` tune each new bucket on first use
(outside CUDA-graph capture). The cache file is `$LIVEMOE_MOE_CONFIG`, default
~/.cache/livemoe/moe_configs.json, laid out as {gpu name: {bucket key: config dict}}.
"""
import dataclasses
import json
import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MoEConfig:
    block_m: int  # align block size: pairs per program, shared by every kernel of one call
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # expert-weight-gradient kernel tiles (backward only)
    grad_block_m: int = 64
    grad_block_n: int = 64
    grad_block_k: int = 32

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "grad_block_m", "grad_block_n", "grad_block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoEConfig.{name} must be a power of two >= 16, got {v}")


def _pow2_bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket_key(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype) -> str:
    """Tokens are bucketed to powers of two (a config is picked per bucket, not per exact T)."""
    return f"T{_pow2_bucket(num_tokens)}_E{num_experts}_H{hidden}_I{inter}_k{top_k}_{str(dtype).removeprefix('torch.')}"


def heuristic_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                     dtype: torch.dtype) -> MoEConfig:
    """Never-bad defaults: block_m follows the mean pairs per expert (few tokens: small blocks so each touched
    expert's weights stream once with little padding; many: big tiles for tensor-core reuse)."""
    per_expert = num_tokens * top_k / num_experts
    wide = 2 if dtype == torch.float32 else 1  # fp32 tiles cost twice the shared memory
    if num_tokens <= 16 or per_expert <= 16:  # decode: weight-bandwidth bound; narrow N tiles give enough
        return MoEConfig(16, 32, 128 // wide, group_m=1, num_warps=4, num_stages=4)  # programs, long K loads
    if per_expert <= 48:
        return MoEConfig(32, 64, 64 // wide, group_m=8, num_warps=4, num_stages=4)
    if per_expert <= 192:
        return MoEConfig(64, 64, 64 // wide, group_m=8, num_warps=4, num_stages=3)
    # (fp32's 128-row weight-gradient tile spills 16 bytes on sm_90: half the rows)
    return MoEConfig(64, 128, 64 // wide, group_m=8, num_warps=8, num_stages=3, grad_block_m=128 // wide,
                     grad_block_n=64)


def cache_path() -> str:
    return os.environ.get("LIVEMOE_MOE_CONFIG", os.path.join(os.path.expanduser("~"), ".cache", "livemoe",
                                                             "moe_configs.json"))


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


_LOADED: dict[str, dict] = {}  # path -> file contents, read once per process


def _load(path: str) -> dict:
    if path not in _LOADED:
        try:
            with open(path) as f:
                _LOADED[path] = json.load(f)
        except FileNotFoundError:
            _LOADED[path] = {}
        except (OSError, ValueError) as e:  # a broken cache must not break the model: fall back, say why
            log.warning("ignoring MoE config cache %s: %s", path, e)
            _LOADED[path] = {}
    return _LOADED[path]


def load_tuned(path: str | None = None) -> dict:
    """{gpu name: {bucket key: config dict}} from the cache file (empty when there is none)."""
    return _load(path or cache_path())


def save_config(key: str, config: MoEConfig, gpu: str | None = None, path: str | None = None) -> None:
    path = path or cache_path()
    data = _load(path)
    data.setdefault(gpu or device_name(), {})[key] = dataclasses.asdict(config)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: concurrent readers see the old or the new file, never half of one


def get_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
               gpu: str | None = None) -> MoEConfig:
    key = bucket_key(num_tokens, num_experts, hidden, inter, top_k, dtype)
    tuned = _load(cache_path()).get(gpu or device_name(), {}).get(key)
    if tuned is not None:
        try:
            return MoEConfig(**tuned)
        except (TypeError, ValueError) as e:
            log.warning("ignoring tuned MoE config %s for %s: %s", tuned, key, e)
    return heuristic_config(num_tokens, num_experts, hidden, inter, top_k, dtype)


def candidate_configs(num_tokens: int, num_experts: int, top_k: int) -> list[MoEConfig]:
    per_expert = num_tokens * top_k / num_experts
    block_ms = [16, 32] if per_expert <= 16 else [32, 64, 128]
    out = []
    for bm in block_ms:
        for bn in (32, 64, 128):
            for bk in (64, 128) if bm <= 32 else (32, 64):
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    out.append(MoEConfig(bm, bn, bk, group_m=1 if bm == 16 else 8, num_warps=warps, num_stages=stages))
    return out


def tune(run, num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
         candidates: list[MoEConfig] | None = None, timer=None, save: bool = True) -> MoEConfig:
    """Time `run(config)` for each candidate (default timer: triton.testing.do_bench on CUDA), save the fastest.

    A candidate that fails to compile or run (e.g. out of shared memory) is skipped, never fatal."""
    if timer is None:
        import triton.testing

        timer = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=20)  # noqa: E731
    best, best_t = None, float("inf")
    for cfg in candidate_configs(num_tokens, num_experts, top_k) if candidates is None else candidates:
        try:
            t = timer(lambda: run(cfg))
        except Exception as e:  # noqa: BLE001  (a config the GPU cannot run is just not a candidate)
            log.debug("MoE config %s failed: %s", cfg, e)
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        best = heuristic_config(num_tokens, num_experts, hidden, inter, top_k, dtype)
        log.warning("MoE autotune: no candidate ran; keeping the heuristic %s", best)
    elif save:
        save_config(bucket_key(num_tokens, num_experts, hidden, inter, top_k, dtype), best)
    return best
