"""Tune the MoE block sizes on this GPU and save them (configs.py): run once per GPU model.

    python -m livemoe.kernels.moe.tune --hidden 2048 --inter 768 --experts 128 --top-k 8 --tokens 1 16 64 512 4096
    python -m livemoe.kernels.moe.tune --prune-only ...   (no GPU needed: which candidates survive, and why not)

Each token count's `candidate_configs` are first compiled for sm_90a (H100/H200), forward and backward,
and a config is dropped, before any GPU time is spent, where a launch does not compile, needs more shared
memory than a block may have, or spills registers (livemoe/kernels/static_resources.py). The survivors are timed
(forward; the backward shares block_m and the tiles) and the winner is written to the JSON cache under
this GPU's name, where `fused_moe` finds it.
"""
import argparse
import os

import torch

from livemoe.kernels.moe.configs import MoEConfig, cache_path, candidate_configs, device_name, tune
from livemoe.kernels.moe.routing import route


def sm90_problems(cfg: MoEConfig, num_tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                  dtype: torch.dtype, backward: bool = True) -> list[str]:
    """Why cfg's launches are unfit for sm_90a (empty when fit): compile errors, shared memory over the
    block limit, stack bytes (spilled registers) in any launch."""
    from livemoe.kernels.moe.launches import moe_launches
    from livemoe.kernels.static_resources import measure_launch

    out = []
    for launch in moe_launches(cfg, num_tokens, hidden, inter, experts, top_k, dtype, backward):
        r = measure_launch(launch)
        if r.error:
            out.append(f"{r.case}: {r.error[:200]}")
        elif r.stack_bytes:
            out.append(f"{r.case}: {r.stack_bytes} stack bytes at {r.registers} registers")
    return out


def prune_candidates(candidates: list[MoEConfig], num_tokens: int, hidden: int, inter: int, experts: int,
                     top_k: int, dtype: torch.dtype, backward: bool = True) -> tuple[list[MoEConfig], dict]:
    """-> (the candidates fit for sm_90a, {dropped candidate: its problems})."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("pruning compiles the kernels: unset TRITON_INTERPRET")
    kept, dropped = [], {}
    for cfg in candidates:
        why = sm90_problems(cfg, num_tokens, hidden, inter, experts, top_k, dtype, backward)
        if why:
            dropped[cfg] = why
        else:
            kept.append(cfg)
    return kept, dropped


def pruned_candidates(num_tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
                      verbose: bool = True) -> list[MoEConfig]:
    kept, dropped = prune_candidates(candidate_configs(num_tokens, experts, top_k), num_tokens, hidden, inter,
                                     experts, top_k, dtype)
    if verbose:
        print(f"T={num_tokens}: {len(kept)} of {len(kept) + len(dropped)} candidates fit sm_90a")
        for cfg, why in dropped.items():
            print(f"  dropped {cfg}: {why[0]}" + (f" (+{len(why) - 1} more)" if len(why) > 1 else ""))
    return kept


def tune_shapes(tokens: list[int], hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype) -> dict:
    from livemoe.kernels.moe.triton_moe import experts_forward

    g = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dtype, generator=g) / hidden ** 0.5
    w_down = torch.randn(experts, hidden, inter, device="cuda", dtype=dtype, generator=g) / inter ** 0.5
    best = {}
    for t in tokens:
        x = torch.randn(t, hidden, device="cuda", dtype=dtype, generator=g)
        topk_w, topk_ids = route(torch.randn(t, experts, device="cuda", generator=g), top_k, True)

        def run(cfg):
            with torch.no_grad():
                experts_forward(x, w_gate_up, w_down, topk_w, topk_ids, cfg, save_preact=False)

        best[t] = tune(run, t, experts, hidden, inter, top_k, dtype,
                       candidates=pruned_candidates(t, hidden, inter, experts, top_k, dtype))
        print(f"T={t}: {best[t]}")
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--prune-only", action="store_true", help="list the candidates fit for sm_90a and stop (no GPU)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.prune_only:
        for t in args.tokens:
            pruned_candidates(t, args.hidden, args.inter, args.experts, args.top_k, dtype)
        return
    if not torch.cuda.is_available():
        raise SystemExit("livemoe.kernels.moe.tune needs a CUDA GPU (the defaults work everywhere without tuning)")
    tune_shapes(args.tokens, args.hidden, args.inter, args.experts, args.top_k, dtype)
    print(f"saved for {device_name()!r} in {cache_path()}")


if __name__ == "__main__":
    main()
