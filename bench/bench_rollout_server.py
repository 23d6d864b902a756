"""Rollout servers for RL (livemoe/engine/core): how long a weight update takes under a running engine core,
by model size, from disk (`update_weights_from_disk`) against a broadcast from a trainer process over a
gloo group (`update_weights_from_distributed`; NCCL on GPUs), both through AsyncLLM's calls (the HTTP
routes add one request each); and the decode throughput of 2 data-parallel engine cores against 1 on
the same requests (on a 2-core CPU the cores compete for the same cores: expect little gain there).
"""
import asyncio
import time

import pytest
import torch
from tiny_tokenizer import make_text_checkpoint

from bench.common import record
from livemoe.engine.async_llm import AsyncLLM
from livemoe.engine.core.weight_sync import WeightSender
from livemoe.engine.model.loader import load_model
from livemoe.engine.net import free_port
from livemoe.engine.sampling.params import SamplingParams

SIZES = {"quick": [dict(hidden_size=64)], "full": [dict(hidden_size=64), dict(hidden_size=256, num_hidden_layers=6)]}
THROUGHPUT = {"quick": (16, 8), "full": (64, 32)}  # (requests, max_tokens)
OPTIONS = dict(dtype=torch.float32, use_tqdm=False, block_size=16, num_kv_blocks=256)


async def update_times(engine: AsyncLLM, path: str, model, reps: int) -> tuple[float, float]:
    """Median seconds of an update from disk and of one over a gloo group, alternately."""
    named = list(model.named_parameters())
    port = free_port()
    loop = asyncio.get_running_loop()
    join = asyncio.ensure_future(engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo"))
    sender = await loop.run_in_executor(None, WeightSender, "127.0.0.1", port, 2)
    await join
    disk, dist = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        await engine.update_weights_from_disk(path)
        disk.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        names, dtypes, shapes = [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named]
        call = asyncio.ensure_future(engine.update_weights_from_distributed(names, dtypes, shapes))
        await loop.run_in_executor(None, sender.broadcast, named)
        await call
        dist.append(time.perf_counter() - t0)
    return sorted(disk)[reps // 2], sorted(dist)[reps // 2]


async def throughput(engine: AsyncLLM, requests: int, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i):
        return sum([len(d.token_ids) async for d in engine.generate(f"rollout {i} of the batch", params)])

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
    return tokens / (time.perf_counter() - t0)


@pytest.mark.slow  # ~20 s in quick mode too: two engine-core processes and a gloo group
def test_weight_update_and_replicas(benchmark, bench_mode, device, tmp_path):
    if device != "cpu":
        pytest.skip("the CPU figures (gloo); on a GPU the same calls use NCCL: run the commands of docs/serving.md")
    reps = 1 if bench_mode == "quick" else 3
    for shape in SIZES[bench_mode]:
        path = make_text_checkpoint(tmp_path / f"h{shape['hidden_size']}", moe=True, **shape)[0]
        model = load_model(path, dtype=torch.float32, device="cpu")
        mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        engine = AsyncLLM(path, engine_core="process", device="cpu", threads=1, **OPTIONS)
        try:
            disk, dist = asyncio.run(update_times(engine, path, model, reps))
        finally:
            engine.shutdown()
        case = f"weight update, {mib:.1f} MiB"
        record(suite="rollout_server", case=case + ": broadcast (gloo) vs from disk", metric="ms", ours=1e3 * dist,
               baseline=1e3 * disk, baseline_name="update_weights_from_disk", extra={"MiB": mib})
    requests, max_tokens = THROUGHPUT[bench_mode]
    path = make_text_checkpoint(tmp_path / "tp", moe=True)[0]
    tps = {}
    for n in (1, 2):
        engine = AsyncLLM(path, engine_core="process", data_parallel_size=n, device="cpu", threads=1, **OPTIONS)
        try:
            asyncio.run(throughput(engine, 2, 4))  # warm-up
            tps[n] = asyncio.run(throughput(engine, requests, max_tokens))
        finally:
            engine.shutdown()
    record(suite="rollout_server", case=f"decode throughput, {requests} requests x {max_tokens} tok: 2 replicas vs 1",
           metric="tok/s", ours=tps[2], baseline=tps[1], baseline_name="1 engine core", higher_is_better=True)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
