"""Tune the MoE block sizes on this GPU and save them (configs.py): run once per GPU model.

    python -m kernels.moe.tune --hidden 2048 --inter 768 --experts 128 --top-k 8 --tokens 1 16 64 512 4096

Each token count is timed over `candidate_configs` (forward; the backward shares block_m and the tiles)
and the winner is written to the JSON cache under this GPU's name, where `fused_moe` finds it.
"""
import argparse

import torch

from kernels.moe.configs import cache_path, device_name, tune
from kernels.moe.routing import route


def tune_shapes(tokens: list[int], hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype) -> dict:
    from kernels.moe.triton_moe import experts_forward

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

        best[t] = tune(run, t, experts, hidden, inter, top_k, dtype)
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
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels.moe.tune needs a CUDA GPU (the defaults work everywhere without tuning)")
    tune_shapes(args.tokens, args.hidden, args.inter, args.experts, args.top_k, getattr(torch, args.dtype))
    print(f"saved for {device_name()!r} in {cache_path()}")


if __name__ == "__main__":
    main()
