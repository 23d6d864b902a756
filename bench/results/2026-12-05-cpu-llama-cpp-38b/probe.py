"""Same-process probe: the small MoE's decode tok/s at each batch, ours and (PEER: a llama-cpp-python site dir)
llama.cpp alternated; run from a checkout with PYTHONPATH set to it. Usage: probe.py f32|f16 1,8 REPS
(THREADS, NEW: threads and new tokens)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
from tiny_models import make_checkpoint  # noqa: E402

from bench.bench_decode import MODELS, ours_greedy_decode, random_prompts  # noqa: E402


def main():
    dtype = sys.argv[1] if len(sys.argv) > 1 else "f32"
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    threads = int(os.environ.get("THREADS", "1"))
    new, plen = int(os.environ.get("NEW", "64")), 32
    torch.set_num_threads(threads)
    path = "/tmp/38b/small_moe"
    if not os.path.exists(path + "/config.json"):
        make_checkpoint(path, moe=True, **MODELS["small MoE"])
    from livemoe.engine.llm import LLM
    llm = LLM(path, dtype=torch.float32 if dtype == "f32" else torch.float16, device="cpu", max_num_seqs=64,
              num_kv_blocks=64 * ((plen + new) // 16 + 2), use_tqdm=False)
    peer = None
    if os.environ.get("PEER"):
        sys.path.append(os.environ["PEER"])
        from bench import llamacpp_peer
        from livemoe.engine.model.gguf_export import export_gguf
        g = f"/tmp/38b/small_{dtype}.gguf"
        if not os.path.exists(g):
            export_gguf(path, g, dtype)
        peer = llamacpp_peer.LlamaCppPeer(g, threads, n_seq=64, n_ctx_per_seq=plen + new + 8, kv_f16=dtype == "f16")
    for b in batches:
        prompts = random_prompts(b, plen, plen, 4096, seed=b)
        ours_greedy_decode(llm, prompts, new)
        if peer:
            peer.greedy(prompts, new)
        ts, tp = [], []
        for _ in range(reps):
            ts.append(ours_greedy_decode(llm, prompts, new)[1])
            if peer:
                tp.append(peer.greedy(prompts, new)[1])
        ts.sort()
        tp.sort()
        n = b * (new - 1)
        line = f"{dtype} thr{threads} batch {b}: ours {n/ts[len(ts)//2]:.0f} tok/s ({1e3*ts[len(ts)//2]/(new-1):.3f} ms/step)"
        if peer:
            line += f"  llama.cpp {n/tp[len(tp)//2]:.0f} tok/s  ratio {tp[len(tp)//2]/ts[len(ts)//2]:.3f}"
        print(line, "load", os.getloadavg()[0], flush=True)
    llm.close()
    if peer:
        peer.close()


main()
