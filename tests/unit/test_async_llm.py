"""AsyncLLM from plain asyncio, as a service embeds it: concurrent generate() calls each get exactly
what LLM.generate gives; leaving early (break / aclose, or cancelling the task) aborts and frees the
KV blocks; a bad request raises RequestError and the engine keeps serving; shutdown ends what is in
flight with EngineDeadError (tested for both cores, the thread and the process, in
tests/integration/test_engine_core.py)."""
import asyncio

import pytest
import torch

from livemoe.engine.async_llm import AsyncLLM
from livemoe.engine.errors import EngineError
from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.errors import RequestError
from fixtures import collect_deltas as collect, wait_idle
from tiny_tokenizer import make_text_checkpoint

OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=4, num_kv_blocks=256, use_tqdm=False)
WAIT_S = 20.0  # bound on any wait for the engine thread (it needs well under a second here)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("async") / "ckpt", moe=True)[0]


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = AsyncLLM(ckpt, **OPTIONS)
    yield eng
    eng.shutdown()


def test_concurrent_generate_matches_llm(ckpt, engine):
    prompts = [f"viewer {i} asks 你好?" for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, top_k=50, max_tokens=6 + i, ignore_eos=True) for i in range(8)]
    expected = LLM(ckpt, **OPTIONS).generate(prompts, params)

    async def main():
        return await asyncio.gather(*(collect(engine.generate(p, sp)) for p, sp in zip(prompts, params)))

    results = asyncio.run(main())
    for (ids, text, deltas), ref in zip(results, expected):
        assert (ids, text) == (ref.token_ids, ref.text)
        assert len(deltas[0].token_ids) == 1  # the first token is sent on its own
        assert deltas[-1].metrics.ttft > 0 and deltas[-1].metrics.num_output_tokens == len(ref.token_ids)
    assert engine.stats()["kv_blocks_used"] == 0


def test_callers_on_several_event_loops(ckpt, engine):
    """Each thread runs its own event loop; the one engine loop serves them all."""
    import threading

    prompts = [f"thread {i} 🙂" for i in range(3)]
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in LLM(ckpt, **OPTIONS).generate(prompts, p)]
    got = {}

    def worker(i):
        got[i] = asyncio.run(collect(engine.generate(prompts[i], p)))[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert [got.get(i) for i in range(3)] == expected


def test_leaving_early_aborts(engine):
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main():
        # break out of the loop, then close the generator
        gen = engine.generate("a long answer", long)
        async for _ in gen:
            break
        assert engine.stats()["kv_blocks_used"] > 0
        await gen.aclose()
        await wait_idle(engine)
        # cancel the task that consumes the stream
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("another long answer", long):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_idle(engine)

    stats = asyncio.run(main())
    assert stats["num_steps"] < 400  # aborted long before max_tokens


def test_bad_request_raises_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(RequestError, match="context"):
            await collect(engine.generate([5] * 600, SamplingParams(max_tokens=4)))
        with pytest.raises(RequestError, match="already in flight"):
            stream = await engine.add_request("x", SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
            await engine.add_request("y", SamplingParams(max_tokens=4), request_id="dup")
        stream.abort()
        ids, _, _ = await collect(engine.generate("still here", SamplingParams(max_tokens=5, ignore_eos=True)))
        assert len(ids) == 5

    asyncio.run(main())


def test_failed_step_ends_requests_in_flight_and_engine_goes_on(engine, monkeypatch):
    real_step = engine.llm.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine.llm, "step", flaky_step)

    async def main():
        with pytest.raises(EngineError, match="injected failure"):
            await collect(engine.generate("doomed", SamplingParams(max_tokens=50, ignore_eos=True)))
        await wait_idle(engine)
        ids, _, _ = await collect(engine.generate("fine", SamplingParams(max_tokens=4, ignore_eos=True)))
        assert len(ids) == 4

    asyncio.run(main())
    assert engine.error is None
