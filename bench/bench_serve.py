"""Streaming service latency: TTFT and TPOT percentiles seen by N concurrent streaming clients, through
the OpenAI-compatible HTTP server (`livemoe serve` in a child process, as deployed) against the
same workload on `AsyncLLM.generate` called directly in this process. The ratio is the server's
overhead: HTTP, JSON, SSE, the process hop to the engine core, and (with `--engine-core thread`) the
interpreter lock its event loop shares with the engine thread. The goal (issue 15): TTFT and TPOT
medians within 1.2x of direct at 32 streams.

TTFT: request sent -> first token received by the client. TPOT: (last token - first token) / (tokens - 1)
per stream. Greedy, EOS ignored, so every stream produces exactly max_tokens tokens.

How the comparison is kept fair:
- The server's streams are read by a lean client (`sse_stream`: one raw HTTP/1.1 connection per stream
  on asyncio, each event's arrival time taken before anything but the token count is read), so what is
  measured is the server and not the client's own per-chunk work. The official `openai` client is
  measured too (rows marked "openai client"): it builds pydantic objects per chunk in the measuring
  loop, which on a 2-core host adds its own cost to the server arm (the old bench used only it).
- Direct calls run AsyncLLM(engine_core="thread") in this process: the caller's loop and the engine
  thread share one interpreter lock, as an in-process user's would.
- Each case starts with an untimed round of every arm at its own size (the first round at a new batch
  size pays one-time costs: 3x the TTFT on the gpu-step model). Then the arms alternate, `rounds` times,
  so drift on a shared machine hits both; each row gives the spread of the per-round ratio of medians
  (extra.ratio_min / ratio_max).
- The model's step cost is stated: every row says the direct decode step (the direct TPOT median) it
  was measured at. On the tiny model a CPU step is ~1-2 ms, far cheaper than any real model's GPU step,
  so any fixed per-token or per-request serving cost looks large against it; the "gpu-step" model is
  sized so that its CPU step at 32 streams is ~10-30 ms, in the range of a real MoE's decode step on a GPU.

`LIVEMOE_BENCH_SERVE_CASES=tiny:32:64,gpu-step:32:32` runs only those cases of the mode (model:streams:max_tokens,
each one of the mode's), on `--engine-core process` alone and without the openai-client arm: a short run for
comparing two versions of the server under the same load.

CPU: the tiny random Qwen3-MoE (quick and full) and the gpu-step MoE (full), with a byte-level BPE
tokenizer, one thread each; GPU: the same models.
"""
import asyncio
import json
import os
import statistics
import time

import msgspec
import pytest
import torch

# the server's and the client's packages are not on every machine (the GPU image has neither): skip, not fail
for _name in ("fastapi", "uvicorn"):
    pytest.importorskip(_name, reason=f"needs {_name} (the HTTP server's dependencies)")
openai = pytest.importorskip("openai", reason="needs openai (the streaming client)")

from bench.common import record  # noqa: E402
from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.sampling.params import SamplingParams  # noqa: E402
from livemoe.engine.server import ServerProcess  # noqa: E402
from tiny_tokenizer import make_text_checkpoint  # noqa: E402

# model name -> (MoE, tiny_models overrides)
MODELS = {
    "tiny": (True, {}),  # CPU decode step at 32 streams: ~1-2 ms
    "gpu-step": (True, dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, moe_intermediate_size=384)),  # ~10-30 ms
}
CASES = {  # (model, concurrent streams, max_tokens)
    "quick": [("tiny", 8, 16)],
    "full": [("tiny", 1, 64), ("tiny", 8, 64), ("tiny", 32, 64), ("gpu-step", 32, 32)],
}
ENGINE_CORES = {"quick": ["process"], "full": ["process", "thread"]}  # the server's --engine-core (thread: tiny only)
OPENAI_CLIENT_STREAMS = {"quick": 8, "full": 32}  # the cases also measured through the official client
ROUNDS = {"quick": 1, "full": 3}
SERVED_NAME = "bench"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def prompts(n: int) -> list[str]:
    return [f"viewer {i} asks: what is happening in the stream? 直播 {i * 13}" for i in range(n)]


class Stream:
    """One stream's timings and tokens."""

    def __init__(self, t0: float, arrivals: list[float], token_ids: list[int]):
        self.ttft = arrivals[0] - t0
        self.tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
        self.token_ids = token_ids


async def direct(engine: AsyncLLM, n: int, max_tokens: int) -> list[Stream]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt):
        t0, arrivals, ids = time.perf_counter(), [], []
        async for d in engine.generate(prompt, params):
            arrivals += [time.perf_counter()] * len(d.token_ids)
            ids += d.token_ids
        assert len(arrivals) == max_tokens
        return Stream(t0, arrivals, ids)

    return await asyncio.gather(*(one(p) for p in prompts(n)))


def completion_body(prompt: str, max_tokens: int) -> dict:
    return dict(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, ignore_eos=True,
                return_token_ids=True)


async def sse_stream(host: str, port: int, n: int, max_tokens: int) -> list[Stream]:
    """The lean client: POST /v1/completions with stream=true on a raw connection; reads the chunked
    body's server-sent events, timestamps each event as it is complete, then decodes its token ids."""
    decode = msgspec.json.Decoder().decode

    async def one(prompt):
        body = json.dumps(completion_body(prompt, max_tokens)).encode()
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
            arrivals, ids, buffer, done = [], [], b"", False
            while not done:
                size = int((await reader.readline()).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)  # the chunk and its CRLF
                if size == 0:
                    break
                buffer += chunk[:-2]
                *events, buffer = buffer.split(b"\n\n")
                now = time.perf_counter()
                for event in events:
                    assert event.startswith(b"data: "), event
                    if event == b"data: [DONE]":
                        done = True
                        continue
                    new = decode(event[6:])["choices"][0]["token_ids"]
                    arrivals += [now] * len(new)
                    ids += new
        finally:
            writer.close()
        assert done and len(arrivals) == max_tokens, (done, len(arrivals))
        return Stream(t0, arrivals, ids)

    return await asyncio.gather(*(one(p) for p in prompts(n)))


async def openai_stream(url: str, n: int, max_tokens: int) -> list[Stream]:
    """The official client (AsyncOpenAI), parsing each chunk into its pydantic objects as it arrives."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    async def one(prompt):
        body = completion_body(prompt, max_tokens)
        t0, arrivals, ids = time.perf_counter(), [], []
        stream = await client.completions.create(model=body.pop("model"), prompt=body.pop("prompt"),
                                                 max_tokens=body.pop("max_tokens"), temperature=body.pop("temperature"),
                                                 stream=body.pop("stream"), extra_body=body)
        async for chunk in stream:
            new = chunk.choices[0].model_extra["token_ids"]
            arrivals += [time.perf_counter()] * len(new)
            ids += new
        assert len(arrivals) == max_tokens
        return Stream(t0, arrivals, ids)

    try:
        return await asyncio.gather(*(one(p) for p in prompts(n)))
    finally:
        await client.close()


# the engine's options, the same for the direct arm's AsyncLLM and the served one (server_flags)
ENGINE_OPTIONS = dict(block_size=16, num_kv_blocks=512)


def server_flags(device: str) -> list[str]:
    """`livemoe serve` flags for the served arm: fp32 on `device`, ENGINE_OPTIONS."""
    return ["--dtype", "float32", "--device", device] + [f"--{k.replace('_', '-')}={v}"
                                                         for k, v in ENGINE_OPTIONS.items()]


def selected(bench_mode: str) -> tuple[list, list[str], int | None]:
    """The mode's cases, engine cores and openai-client stream count, or the LIVEMOE_BENCH_SERVE_CASES subset."""
    chosen = os.environ.get("LIVEMOE_BENCH_SERVE_CASES")
    if not chosen:
        return CASES[bench_mode], ENGINE_CORES[bench_mode], OPENAI_CLIENT_STREAMS[bench_mode]
    cases = []
    for item in chosen.split(","):
        try:
            model, n, max_tokens = item.split(":")
            case = (model, int(n), int(max_tokens))
        except ValueError:
            raise ValueError(f"LIVEMOE_BENCH_SERVE_CASES: {item!r} is not model:streams:max_tokens") from None
        if case not in CASES[bench_mode]:
            raise ValueError(f"LIVEMOE_BENCH_SERVE_CASES: {item!r} is not a case of the {bench_mode} mode "
                             f"({CASES[bench_mode]})")
        cases.append(case)
    return cases, ["process"], None


def test_serve_latency(benchmark, bench_mode, device, tmp_path):
    cases, engine_cores, openai_streams = selected(bench_mode)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if device == "cpu" else threads)  # small matmuls: OpenMP spinning only hurts
    flags = server_flags(device)
    env = {"OMP_NUM_THREADS": "1"} if device == "cpu" else {}
    try:
        for model in dict.fromkeys(c[0] for c in cases):
            moe, overrides = MODELS[model]
            path, _ = make_text_checkpoint(tmp_path / model, moe=moe, **overrides)
            engine = AsyncLLM(path, dtype=torch.float32, device=device, use_tqdm=False, **ENGINE_OPTIONS)
            cores = engine_cores if model == "tiny" else ["process"]
            for core in cores:
                with ServerProcess(path, SERVED_NAME, flags + ["--engine-core", core], env=env) as server:
                    arms = {"direct": lambda n, t: direct(engine, n, t),
                            "server": lambda n, t: sse_stream(server.host, server.port, n, t)}
                    if core == "process" and openai_streams is not None:
                        arms["openai"] = lambda n, t: openai_stream(server.url, n, t)
                    for arm in arms.values():  # warm up every path (first-call costs)
                        asyncio.run(arm(2, 4))
                    for m, n, max_tokens in cases:
                        if m != model:
                            continue
                        measured = {k: v for k, v in arms.items() if k != "openai"
                                    or n == openai_streams}
                        for arm in measured.values():  # a new batch size's one-time costs (first shapes, allocator)
                            asyncio.run(arm(n, max_tokens))
                        samples = {k: [] for k in measured}
                        for _ in range(ROUNDS[bench_mode]):  # alternate, so drift on a shared machine hits both
                            for k, arm in measured.items():
                                samples[k].append(asyncio.run(arm(n, max_tokens)))
                        check_same_tokens(samples)
                        report(model, n, max_tokens, samples, core)
                    if core == "process" and model == cases[-1][0]:
                        last = cases[-1][1:]
                        benchmark.pedantic(lambda: asyncio.run(arms["server"](*last)), rounds=1, iterations=1)
            engine.shutdown()
            assert engine.stats()["kv_blocks_used"] == 0
    finally:
        torch.set_num_threads(threads)


def check_same_tokens(samples: dict) -> None:
    """Greedy: every arm's stream i got the same tokens (the lean client read the events right)."""
    reference = [s.token_ids for s in samples["direct"][0]]
    assert reference and all(reference)
    for arm, rounds in samples.items():
        for streams in rounds:
            assert [s.token_ids for s in streams] == reference, f"{arm}: other tokens than the direct calls"


def report(model: str, n: int, max_tokens: int, samples: dict, core: str) -> None:
    flat = {k: [s for r in rounds for s in r] for k, rounds in samples.items()}
    step_ms = 1e3 * statistics.median(s.tpot for s in flat["direct"] if s.tpot is not None)
    case = f"{n} streams x {max_tokens} tok, {model} model" + ("" if core == "process" else f", --engine-core {core}")
    for arm, label in (("server", ""), ("openai", ", openai client")):
        if arm not in samples:
            continue
        for what in ("ttft", "tpot"):
            per_round = [_ratio(samples[arm][i], samples["direct"][i], what) for i in range(len(samples[arm]))]
            vals = {k: [getattr(s, what) for s in flat[k] if getattr(s, what) is not None] for k in (arm, "direct")}
            for q in (0.5, 0.9, 0.99) if arm == "server" else (0.5,):
                record(suite="serve", case=f"{what.upper()} p{int(q * 100)} {case}{label}", metric="ms",
                       ours=1e3 * percentile(vals[arm], q), baseline=1e3 * percentile(vals["direct"], q),
                       baseline_name="AsyncLLM.generate direct", kind="overhead",
                       extra={"streams": n, "samples": len(vals[arm]), "direct_step_ms": round(step_ms, 2),
                              "ratio_min": round(min(per_round), 3), "ratio_max": round(max(per_round), 3),
                              "rounds": len(per_round)})
    tps = {}  # tokens per second across all streams, from each path's own mean TPOT
    for k in ("server", "direct"):
        tpots = [s.tpot for s in flat[k] if s.tpot is not None]
        tps[k] = n / statistics.mean(tpots) if tpots else 0.0
    record(suite="serve", case=f"decode throughput {case}", metric="tok/s", ours=tps["server"], baseline=tps["direct"],
           baseline_name="AsyncLLM.generate direct", higher_is_better=True, kind="overhead",
           extra={"direct_step_ms": round(step_ms, 2)})


def _ratio(arm: list[Stream], direct_streams: list[Stream], what: str) -> float:
    """One round's median of `what` through the server over the direct calls'."""
    def med(streams):
        return statistics.median(v for s in streams if (v := getattr(s, what)) is not None)
    return med(arm) / med(direct_streams)
