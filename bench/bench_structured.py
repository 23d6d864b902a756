"""Structured output's cost: the decode step time of a batch with 0, 1 and all of its requests constrained
by a JSON schema (ratio to the unconstrained batch), the sampler's added check on a batch with no
constrained request, and the grammar compile time of a schema shaped like the seed's decisions.

The tiny random MoE of tests/ with its byte-level BPE tokenizer (vocab 320; no network, so no real
tokenizer: a 150k vocabulary makes each row's mask fill and compile slower). Constrained rows follow a
schema whose reply string must be long, so no row finishes while the steps are timed; every row samples
(temperature 1, a seed). Batch 64 and 16 timed decode steps (quick: batch 16, 4 steps), median of the
repetitions, the three cases run alternately.
"""
import json
import statistics
import time

import pytest
import torch

pytest.importorskip("xgrammar", reason="needs xgrammar (a runtime dependency: pip install -e .)")

from bench.common import record  # noqa: E402
from livemoe.engine.llm import LLM  # noqa: E402
from livemoe.engine.sampling.sampler import Sampler  # noqa: E402
from livemoe.engine.sampling.params import SamplingParams  # noqa: E402
from livemoe.engine.sampling.structured import GrammarCompiler, StructuredOutput  # noqa: E402

SUITE = "structured"
pytestmark = pytest.mark.usefixtures("one_thread")
LONG_REPLY = {"type": "object", "properties": {"reply": {"type": "string", "minLength": 400}}, "required": ["reply"],
              "additionalProperties": False}
DECISION = {  # the shape of a live assistant's decision
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["reply", "recommend", "lookup", "ignore", "escalate"]},
        "reply": {"type": "string", "maxLength": 280},
        "product_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 5},
        "tool": {"type": "object", "properties": {
            "name": {"type": "string", "enum": ["search_products", "get_price", "get_stock"]},
            "arguments": {"type": "object", "properties": {"query": {"type": "string"}, "id": {"type": "integer"}},
                          "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["action", "reply", "confidence"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, device):
    from tiny_tokenizer import make_text_checkpoint

    path, _ = make_text_checkpoint(tmp_path_factory.mktemp("bench_structured") / "ckpt", moe=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LLM(path, dtype=dtype, device=device, block_size=16, num_kv_blocks=2048, max_model_len=512,
               max_num_seqs=64, use_tqdm=False)


def step_time(llm: LLM, batch: int, constrained: int, steps: int) -> float:
    """Median seconds of a decode step with `constrained` of `batch` requests under LONG_REPLY."""
    spec = StructuredOutput(json=LONG_REPLY)
    ids = [llm.add_request(f"viewer {i} asks about item {i * 7}",
                           SamplingParams(temperature=1.0, seed=i, max_tokens=400,
                                          **({"structured": spec} if i < constrained else {"ignore_eos": True})))
           for i in range(batch)]
    while any(s.num_output_tokens == 0 for r in llm.core.requests.values() for s in r.seqs):
        llm.step()  # prefill
    times = []
    for _ in range(steps):
        if llm.core.runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t0)
    assert len(llm.core.requests) == batch, "a request finished while the steps were timed"
    for rid in ids:
        llm.abort(rid)
    return statistics.median(times)


def test_step_time_with_constrained_rows(engine, bench_mode):
    batch, steps, reps = (64, 16, 3) if bench_mode == "full" else (16, 4, 1)
    engine.compile_grammar(StructuredOutput(json=LONG_REPLY))  # compiled before the timing, as a server does
    cases = {0: [], 1: [], batch: []}
    for k in cases:  # warm-up
        step_time(engine, batch, k, 2)
    for _ in range(reps):
        for k in cases:
            cases[k].append(step_time(engine, batch, k, steps))
    base = statistics.median(cases[0])
    for k, ts in cases.items():
        t = statistics.median(ts)
        record(suite=SUITE, case=f"decode step, batch {batch}, {k} constrained", metric="ms", ours=t * 1e3,
               baseline=base * 1e3, baseline_name="no constrained request")
        assert t > 0


def test_no_constrained_request_check_cost(bench_mode, device):
    """What a step with no constrained request pays for the feature: one attribute read per row."""
    batch, V = 64, 151_936 if bench_mode == "full" else 4096
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(batch)]
    logits = torch.randn(batch, V, device=device)
    sampler = Sampler()
    gens = [None] * batch
    reps = 50 if bench_mode == "full" else 5
    sampler(logits, params, gens)
    t0 = time.perf_counter()
    for _ in range(reps):
        sampler(logits, params, gens)
    if device == "cuda":
        torch.cuda.synchronize()
    call = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(1000):
        any(p.processes_logits for p in params)
    check = (time.perf_counter() - t0) / 1000
    record(suite=SUITE, case=f"sampler call, {batch} unconstrained rows, V {V}", metric="us", ours=call * 1e6)
    record(suite=SUITE, case=f"the processing check in it, {batch} rows", metric="us", ours=check * 1e6,
           extra={"share of the sampler call": check / call})
    assert check < call


def test_grammar_compile_time(engine, bench_mode):
    reps = 10 if bench_mode == "full" else 2
    times = []
    for _ in range(reps):
        compiler = GrammarCompiler(engine.tokenizer, engine.core.vocab_size, engine.core.eos_token_ids)  # an empty cache
        t0 = time.perf_counter()
        compiler.compile(StructuredOutput(json=json.dumps(DECISION)))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    compiler.compile(StructuredOutput(json=DECISION))  # a cache hit (the same schema as a dict)
    hit = time.perf_counter() - t0
    record(suite=SUITE, case=f"compile the decision schema (vocab {engine.core.vocab_size})", metric="ms",
           ours=statistics.median(times) * 1e3, extra={"cache hit ms": hit * 1e3})
    assert compiler.num_compiled == 1 and hit < statistics.median(times)
