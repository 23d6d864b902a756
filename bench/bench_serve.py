"""Streaming service latency: TTFT and TPOT percentiles seen by N concurrent streaming clients, through
the OpenAI-compatible HTTP server (`python -m engine.serve` in a child process, as deployed; the
official `openai` AsyncOpenAI client here, over loopback) against the same workload on
`AsyncLLM.generate` called directly in this process. The ratio is the server's overhead: HTTP, JSON,
SSE, and (with `--engine-core thread`) the GIL its event loop shares with the engine thread; the
default server runs the engine in its own process (engine/core), and the full mode measures both.

TTFT: request sent -> first token received by the client. TPOT: (last token - first token) / (tokens - 1)
per stream. Greedy, EOS ignored, so every stream produces exactly max_tokens tokens.
CPU: a tiny random Qwen3 (quick) / tiny Qwen3-MoE (full) with a byte-level BPE tokenizer; GPU: the same
tiny MoE (what is measured is the serving path's overhead, not the model).
"""
import asyncio
import statistics
import time

import pytest
import torch

# the server's and the client's packages are not on every machine (the GPU image has neither): skip, not fail
for _name in ("fastapi", "uvicorn"):
    pytest.importorskip(_name, reason=f"needs {_name} (the HTTP server's dependencies)")
openai = pytest.importorskip("openai", reason="needs openai (the streaming client)")

from bench.common import record  # noqa: E402
from engine.async_llm import AsyncLLM  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.server import ServerProcess  # noqa: E402
from tiny_tokenizer import make_text_checkpoint  # noqa: E402

CASES = {  # (concurrent streams, max_tokens)
    "quick": [(8, 16)],
    "full": [(1, 64), (8, 64), (32, 64)],
}
ENGINE_CORES = {"quick": ["process"], "full": ["process", "thread"]}  # the server's --engine-core
MODEL = "bench"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def prompts(n: int) -> list[str]:
    return [f"viewer {i} asks: what is happening in the stream? 直播 {i * 13}" for i in range(n)]


def timings(t0: float, arrivals: list[float]) -> tuple[float, float | None]:
    ttft = arrivals[0] - t0
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
    return ttft, tpot


async def direct(engine: AsyncLLM, n: int, max_tokens: int) -> list[tuple[float, float | None]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt):
        t0, arrivals = time.perf_counter(), []
        async for d in engine.generate(prompt, params):
            arrivals += [time.perf_counter()] * len(d.token_ids)
        assert len(arrivals) == max_tokens
        return timings(t0, arrivals)

    return await asyncio.gather(*(one(p) for p in prompts(n)))


async def via_server(url: str, n: int, max_tokens: int) -> list[tuple[float, float | None]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    async def one(prompt):
        t0, arrivals = time.perf_counter(), []
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            arrivals += [time.perf_counter()] * len(chunk.choices[0].model_extra["token_ids"])
        assert len(arrivals) == max_tokens
        return timings(t0, arrivals)

    try:
        return await asyncio.gather(*(one(p) for p in prompts(n)))
    finally:
        await client.close()


def test_serve_latency(benchmark, bench_mode, device, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if device == "cpu" else threads)  # tiny matmuls: OpenMP spinning only hurts
    options = dict(block_size=16, num_kv_blocks=512)
    flags = ["--dtype", "float32", "--device", device] + [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    env = {"OMP_NUM_THREADS": "1"} if device == "cpu" else {}
    try:
        path, _ = make_text_checkpoint(tmp_path / "ckpt", moe=bench_mode == "full")
        engine = AsyncLLM(path, dtype=torch.float32, device=device, use_tqdm=False, **options)
        for core in ENGINE_CORES[bench_mode]:
            with ServerProcess(path, MODEL, flags + ["--engine-core", core], env=env) as server:
                asyncio.run(direct(engine, 2, 4))  # warm up both paths (first-call costs)
                asyncio.run(via_server(server.url, 2, 4))
                rounds = 1 if bench_mode == "quick" else 3
                for n, max_tokens in CASES[bench_mode]:
                    samples = {"direct": [], "server": []}
                    for _ in range(rounds):  # alternate, so drift on a shared machine hits both
                        samples["direct"] += asyncio.run(direct(engine, n, max_tokens))
                        samples["server"] += asyncio.run(via_server(server.url, n, max_tokens))
                    report(n, max_tokens, samples, core)
                if core == ENGINE_CORES[bench_mode][0]:
                    last = CASES[bench_mode][-1]
                    benchmark.pedantic(lambda: asyncio.run(via_server(server.url, *last)), rounds=1, iterations=1)
        engine.shutdown()
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        torch.set_num_threads(threads)


def report(n: int, max_tokens: int, samples: dict, core: str) -> None:
    case = f"{n} streams x {max_tokens} tok" + ("" if core == "process" else f", --engine-core {core}")
    for what, idx in (("TTFT", 0), ("TPOT", 1)):
        vals = {k: [s[idx] for s in v if s[idx] is not None] for k, v in samples.items()}
        for q in (0.5, 0.9, 0.99):
            record(suite="serve", case=f"{what} p{int(q * 100)} {case}", metric="ms",
                   ours=1e3 * percentile(vals["server"], q), baseline=1e3 * percentile(vals["direct"], q),
                   baseline_name="AsyncLLM.generate direct", kind="overhead",
                   extra={"streams": n, "samples": len(vals["server"])})
    # tokens per second across all streams, from each path's own mean TPOT
    for k in ("server", "direct"):
        tpots = [s[1] for s in samples[k] if s[1] is not None]
        samples[k + "_tps"] = n / statistics.mean(tpots) if tpots else 0.0
    record(suite="serve", case=f"decode throughput {case}", metric="tok/s", ours=samples["server_tps"],
           baseline=samples["direct_tps"], baseline_name="AsyncLLM.generate direct", higher_is_better=True, kind="overhead")
