"""Tensor / expert-parallel decode over N processes (livemoe/engine/decoder/workers.py), on the CPU with gloo:
TP 2 gives transformers' greedy tokens and the single-process engine's logprobs (prefix caching and
preemption on), through LLM, AsyncLLM (thread and process engine core) and the OpenAI server; the KV
cache's release and sleep reach the workers; what TP cannot do is refused by name; bad sizes fail before
any process starts; no worker outlives close(), garbage collection, a worker's exception or kill, or the
server's SIGTERM (checked in /proc)."""
import asyncio
import gc
import json
import os
import signal
import time

import pytest
import torch

from livemoe.engine.async_llm import AsyncLLM
from livemoe.engine.errors import EngineConfigError, EngineDeadError, WorkerError
from livemoe.engine.llm import LLM
from livemoe.engine.decoder.workers import FAULT_ENV
from livemoe.engine.sampling.params import SamplingParams
from docs_text import section
from fixtures import collect_deltas
from tiny_models import hf_model
from tiny_tokenizer import make_text_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=4, use_tqdm=False, threads=1)
# fp32 on both sides; the replicated (and the tensor-parallel) forward differ from one process only in
# the order of their sums
LOGPROB_ATOL = 1e-4


def children(pid: int) -> list[int]:
    """The live processes whose parent is pid (from /proc; zombies excluded)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def gone(pids: list[int], within_s: float = 15.0) -> bool:
    """Whether the processes have exited (a zombie counts: its parent reaps it) within the time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(map(running, pids)):
            return True
        time.sleep(0.05)
    return False


def running(pid: int) -> bool:
    """Whether any thread of pid still runs (a killed process is a zombie only once all of them exited)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in "ZX":
                    return True
        except OSError:
            pass
    return False


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Dense with GQA (4 query heads, 2 KV heads) and MoE with 1 KV head, fewer than the 2 ranks."""
    out = {}
    for name, moe, extra in (("dense", False, {}), ("moe", True, dict(num_key_value_heads=1))):
        path, tokenizer = make_text_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", moe=moe, **extra)
        hf = hf_model(moe, 0, vocab_size=len(tokenizer), **extra)  # the saved model (same seed)
        hf.generation_config.eos_token_id = None  # ignore_eos: transformers must not stop either
        out[name] = (path, hf)
    return out


def prompts():
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 120, (21,), generator=g).tolist()
    return [prefix + torch.randint(3, 120, (k,), generator=g).tolist() for k in (1, 5, 9)] + \
           [torch.randint(3, 120, (k,), generator=g).tolist() for k in (3, 17)]


def hf_greedy(hf, prompt):
    return hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tp2(checkpoints):
    """The TP 2 engine of (checkpoint, expert parallel), shared by the tests below while they ask for the same
    one (each start costs a process; a process holds one TP engine at a time: the process group is global)."""
    engines = {}

    def get(name, ep=False):
        if (name, ep) not in engines:
            for other in engines.values():
                other.close()
            engines.clear()
            # 30 blocks of 4 tokens: the five sequences (up to 46 tokens each) cannot all fit -> preemption
            engines[name, ep] = LLM(checkpoints[name][0], tensor_parallel_size=2, enable_expert_parallel=ep,
                                    num_kv_blocks=30, **OPTIONS)
        return engines[name, ep]

    def take(name, ep=False):
        """The engine, no longer shared: the caller ends it."""
        get(name, ep)
        return engines.pop((name, ep))

    def close_all():
        for llm in engines.values():
            llm.close()
        engines.clear()

    get.take, get.close_all = take, close_all
    yield get
    for llm in engines.values():
        llm.close()


@pytest.mark.parametrize("name,ep", [("moe", False), ("moe", True), ("dense", False)], ids=["moe", "moe-ep", "dense"])
def test_tp2_greedy_equals_transformers_and_one_process(checkpoints, tp2, name, ep):
    path, hf = checkpoints[name]
    ps = prompts()
    expected = [hf_greedy(hf, p) for p in ps]
    one = LLM(path, num_kv_blocks=256, **OPTIONS).generate(ps, GREEDY)
    llm = tp2(name, ep)
    assert len(llm.core.workers.pids) == 1
    outs = llm.generate(ps, GREEDY)
    again = llm.generate(ps[:3], GREEDY)  # the shared prefix is cached now
    stats = llm.stats()
    assert len(outs) == len(expected) == 5
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.outputs[0].token_ids for o in again] == expected[:3]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["tensor_parallel_size"] == 2 and stats["expert_parallel"] is ep
    for a, b in zip(outs, one):
        lp_tp = torch.tensor([next(iter(d.values())) for d in a.outputs[0].logprobs])
        lp_one = torch.tensor([next(iter(d.values())) for d in b.outputs[0].logprobs])
        assert lp_tp.shape == lp_one.shape == (NEW,)
        torch.testing.assert_close(lp_tp, lp_one, atol=LOGPROB_ATOL, rtol=0)
    # flops per token are the model's, not a rank's
    assert outs[0].metrics.decode_flops == one[0].metrics.decode_flops > 0


def test_tp2_with_ngram_speculation_equals_transformers(checkpoints, tp2):
    """The verification's k+1-token chunks and their several logits rows go to the workers like any step."""
    path, hf = checkpoints["moe"]
    ps = [p + p[:6] for p in prompts()]  # a repeat in each prompt: prompt lookup finds drafts
    expected = [hf_greedy(hf, p) for p in ps]
    tp2.close_all()  # one tensor-parallel engine per process at a time
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=30, **OPTIONS,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == expected
        stats = llm.stats()
        assert stats["spec_accepted_tokens"] > 0 and stats["num_preemptions"] > 0
    finally:
        llm.close()


def test_tp2_with_a_draft_model_on_rank_0_equals_transformers(checkpoints, tp2):
    """A draft model runs whole on rank 0 beside the TP-2 target; the dense checkpoint drafting for the MoE one
    (same tokenizer) is rejected often enough to roll back, and greedy tokens stay the target's."""
    path, hf = checkpoints["moe"]
    ps = prompts()
    expected = [hf_greedy(hf, p) for p in ps]
    tp2.close_all()
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=60, **OPTIONS,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                  "model": checkpoints["dense"][0], "disable_by_batch_size": 8})
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == expected
        stats = llm.stats()
        assert stats["spec_drafted_tokens"] > stats["spec_accepted_tokens"]
    finally:
        llm.close()


def test_kv_cache_release_sleep_refusals_and_close(checkpoints, tp2):
    path, hf = checkpoints["dense"]
    ps = prompts()[:2]
    expected = [hf_greedy(hf, p) for p in ps]
    llm = tp2.take("dense")
    try:
        with llm.kv_cache_released():  # every rank frees its cache, and allocates it again after
            assert llm.core.runner.kv_cache is None
        assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == expected
        llm.sleep(1)
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == expected
        with pytest.raises(RuntimeError, match="sleep\\(level=2\\) is not supported with tensor_parallel_size=2"):
            llm.sleep(2)
        assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == expected
        pids = llm.core.workers.pids
        before = children(os.getpid())
        with pytest.raises(EngineConfigError, match="another engine with tensor_parallel_size > 1 \\(close\\(\\) it"):
            LLM(path, tensor_parallel_size=2, **OPTIONS)
        assert children(os.getpid()) == before
    finally:
        llm.close()
    assert gone(pids)
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate(ps, GREEDY)


@pytest.mark.parametrize("options,message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
    (dict(tensor_parallel_size=-2), "tensor_parallel_size must be a positive integer, got -2"),
    (dict(tensor_parallel_size="2"), "tensor_parallel_size must be a positive integer, got '2'"),
    (dict(enable_expert_parallel=True), "enable_expert_parallel needs tensor_parallel_size > 1"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True), "enable_expert_parallel needs an MoE model"),
    (dict(tensor_parallel_size=2, device="cuda"), "tensor_parallel_size=2 needs 2 CUDA devices"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model.s num_attention_heads"),
])
def test_bad_sizes_fail_before_any_process_starts(checkpoints, options, message):
    if options.get("device") == "cuda" and torch.cuda.device_count() >= 2:
        options = dict(options, tensor_parallel_size=torch.cuda.device_count() + 1)
        message = f"tensor_parallel_size={options['tensor_parallel_size']} needs"
    before = children(os.getpid())
    with pytest.raises(EngineConfigError, match=message):
        LLM(checkpoints["dense"][0], **{**OPTIONS, **options})
    assert children(os.getpid()) == before


def test_from_model_refused(checkpoints):
    path, hf = checkpoints["moe"]
    from livemoe.engine.model.loader import load_model

    with pytest.raises(EngineConfigError, match="tensor_parallel_size=2 needs LLM\\(model_path"):
        LLM.from_model(load_model(path, dtype=torch.float32, device="cpu"), tensor_parallel_size=2)


def test_no_worker_left_after_garbage_collection(tp2):
    llm = tp2.take("moe")
    pids = llm.core.workers.pids
    assert pids and all(p in children(os.getpid()) for p in pids)
    del llm
    gc.collect()
    assert gone(pids)


@pytest.mark.parametrize("fault", ["exception", "kill"])
def test_a_failed_worker_ends_rank_0_with_its_rank_and_cause(checkpoints, monkeypatch, fault):
    if fault == "exception":
        monkeypatch.setenv(FAULT_ENV, "1:5")  # worker rank 1 raises at its 6th step
    llm = LLM(checkpoints["moe"][0], tensor_parallel_size=2, num_kv_blocks=64, **OPTIONS)
    (pid,) = llm.core.workers.pids
    try:
        if fault == "kill":
            llm.generate(prompts()[:1], GREEDY)
            os.kill(pid, signal.SIGKILL)
            assert gone([pid])  # (a zombie until rank 0 reaps it)
            message = f"tensor-parallel worker rank 1 \\(pid {pid}\\) killed by SIGKILL"
        else:
            message = "tensor-parallel worker rank 1 failed: RuntimeError\\('injected fault"
        start = time.monotonic()
        with pytest.raises(WorkerError, match=message):
            llm.generate(prompts(), GREEDY)
        assert time.monotonic() - start < 30  # quickly: no collective timeout waited out
        assert gone([pid])
        with pytest.raises(WorkerError, match=message):  # the engine stays failed, with the same cause
            llm.generate(prompts()[:1], GREEDY)
    finally:
        llm.close()


@pytest.mark.slow
def test_async_llm_streaming_and_abort_thread_and_process_core(checkpoints):
    path, hf = checkpoints["moe"]
    ps = prompts()
    expected = hf_greedy(hf, ps[0])

    async def main(engine):
        tokens, _, deltas = await collect_deltas(engine.generate(ps[0], GREEDY))
        assert tokens == expected and len(deltas) > 1  # streamed, token by token
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = engine.generate(ps[1], long)
        got = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()  # aborts: its blocks are freed at the engine's next turn
        assert sum(len(d.token_ids) for d in got) >= 3
        for _ in range(1000):
            s = engine.stats()
            if s["num_requests"] == 0 and s["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.01)
        assert s["num_requests"] == 0 and s["kv_blocks_used"] == 0 and s["tensor_parallel_size"] == 2
        tokens, _, _ = await collect_deltas(engine.generate(ps[0], GREEDY))
        assert tokens == expected

    thread = AsyncLLM(path, tensor_parallel_size=2, num_kv_blocks=128, **OPTIONS)
    pids = thread.llm.core.workers.pids
    try:
        asyncio.run(main(thread))
    finally:
        thread.shutdown()
    assert gone(pids)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect_deltas(thread.generate(ps[0], GREEDY)))

    proc = AsyncLLM(path, engine_core="process", tensor_parallel_size=2, num_kv_blocks=128, **OPTIONS)
    (core,) = proc.core_pids()
    try:
        workers = children(core)
        assert len(workers) == 1  # rank 0 is the engine core; its one worker is rank 1
        asyncio.run(main(proc))
        # rank 0 killed outright (no close, no finalizer): its worker notices that its parent is gone
        os.kill(core, signal.SIGKILL)
        assert gone([core, *workers])
    finally:
        proc.shutdown()


@pytest.mark.slow
def test_openai_server_with_tensor_parallel_and_sigterm(checkpoints):
    openai = pytest.importorskip("openai")
    import urllib.request

    from livemoe.engine.model.loader import load_tokenizer
    from livemoe.engine.server import ServerProcess

    path, hf = checkpoints["moe"]
    server = ServerProcess(path, "tiny", ["--tensor-parallel-size", "2", "--enable-expert-parallel",
                                          "--num-kv-blocks", "64", "--block-size", "4", "--threads", "1",
                                          "--device", "cpu", "--dtype", "float32"]).start()
    try:
        with urllib.request.urlopen(server.url + "/get_server_info", timeout=10) as r:
            info = json.loads(r.read())
        (core,) = info["core_pids"]
        assert info["tensor_parallel_size"] == 2 and info["expert_parallel"] is True
        assert len(children(core)) == 1  # the engine core is rank 0; its worker is rank 1
        procs = descendants(server.proc.pid)  # (with multiprocessing's resource tracker)
        assert core in procs and children(core)[0] in procs
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        prompt = prompts()[0]
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                        extra_body={"ignore_eos": True})
        text = out.choices[0].text
        assert text == load_tokenizer(path).decode(hf_greedy(hf, prompt), skip_special_tokens=True)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == text and text
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'livemoe_tensor_parallel_size{replica="0"} 2.0' in metrics
        assert 'livemoe_expert_parallel_enabled{replica="0"} 1.0' in metrics
    finally:
        server.stop()  # SIGTERM
    assert server.proc.returncode is not None
    assert gone(procs)


def test_serving_memory_per_gpu_and_the_docs_figures(capsys):
    """Per-rank weights: every tensor split N ways except norms and the router (whole) and k/v projections
    (one KV head per rank when fewer KV heads than ranks); docs/serving.md's section on it quotes the CLI's figures."""
    import math

    from livemoe.engine.model.flops import resolve_config
    from livemoe.engine.model.memory import main, param_shapes, rank_numel, serving_memory

    cfg = resolve_config("qwen3-235b-a22b")
    shapes = param_shapes(cfg)
    total = sum(math.prod(s) for _, s in shapes)
    assert rank_numel(cfg, 1) == total
    whole = sum(math.prod(s) for n, s in shapes if n.endswith(("norm.weight", "mlp.gate.weight")))
    kv = sum(math.prod(s) for n, s in shapes if n.endswith(("k_proj.weight", "v_proj.weight")))
    rest = total - whole - kv
    # 4 KV heads: TP 4 splits them, TP 8 holds one per rank (a quarter of k/v, like TP 4)
    assert whole + kv // 4 + rest // 4 <= rank_numel(cfg, 4) <= whole + kv // 4 + rest // 4 + len(shapes)
    assert whole + kv // 4 + rest // 8 <= rank_numel(cfg, 8) <= whole + kv // 4 + rest // 8 + len(shapes)
    m = serving_memory(cfg, 8)
    assert m["kv_bytes_per_token_per_gpu"] == 2 * 94 * 1 * 128 * 2 == serving_memory(cfg, 4)["kv_bytes_per_token_per_gpu"]
    assert serving_memory(cfg, 2)["kv_bytes_per_token_per_gpu"] == 2 * 94 * 2 * 128 * 2
    main(["--model", "qwen3-235b-a22b", "--tensor-parallel-size", "8"])
    out = capsys.readouterr().out
    _, doc = section("One model over several GPUs: serving Qwen3-235B-A22B on 8 GPUs")
    for figure in (f"{m['weights_gb_per_gpu']:.1f} GB", f"{m['model_weights_gb']:.1f}", "47.0 KiB", "67.9 GB"):
        assert figure in out and figure in doc, figure


def test_live_session_decides_the_same_with_tp2(tmp_path):
    """Live sessions drive the engine through its ordinary step loop: with TP 2 their decisions (greedy)
    and their cache reuse are a single process's."""
    from livemoe.engine.live.session import LiveSession

    path, _ = make_text_checkpoint(tmp_path / "live", moe=True, seed=3, max_position_embeddings=2048)
    events = [[{"type": "join", "user": "amy"}], [{"type": "comment", "user": "bob", "text": "price of link 3?"}],
              [{"type": "transcript", "text": "now 29 yuan"}]]

    def decisions(**options):
        llm = LLM(path, block_size=16, num_kv_blocks=128, use_tqdm=False, threads=1, **options)
        try:
            s = LiveSession(llm, "you are the live assistant of a shopping stream.", max_message_chars=24,
                            temperature=0.0)
            got = [s.step(e) for e in events]
            return [(d.kind, d.text, d.metrics.prompt_tokens, d.metrics.cached_prompt_tokens) for d in got]
        finally:
            llm.close()

    one, tp = decisions(), decisions(tensor_parallel_size=2)
    assert len(one) == len(tp) == 3
    assert tp == one and tp[-1][3] > 0  # the last step found the session's earlier intervals cached


def test_a_failed_worker_ends_its_engine_core(checkpoints, monkeypatch):
    """Under the engine-core process: a worker's exception ends the core (it cannot step any more), so its
    requests end with EngineDeadError at once and no process is left."""
    monkeypatch.setenv(FAULT_ENV, "1:3")  # inherited by the core, then by its worker
    engine = AsyncLLM(checkpoints["moe"][0], engine_core="process", tensor_parallel_size=2, num_kv_blocks=64,
                      **OPTIONS)
    (core,) = engine.core_pids()
    workers = children(core)
    try:
        with pytest.raises(EngineDeadError):
            asyncio.run(collect_deltas(engine.generate(prompts()[0], GREEDY)))
        assert gone([core, *workers])
    finally:
        engine.shutdown()


@pytest.mark.parametrize("ep", [False, True], ids=["moe", "moe-ep"])
def test_tp2_routed_experts_equal_one_process(checkpoints, tp2, ep):
    """return_routed_experts under tensor (and expert) parallel: the router is replicated and every rank ends each
    layer with the same hidden states, so rank 0's routing is the model's (nothing to gather); with preemption
    (30 blocks) and prefix hits it equals the one-process engine's."""
    path, _ = checkpoints["moe"]
    ps = prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    one = LLM(path, num_kv_blocks=256, **OPTIONS).generate(ps, params)
    outs = tp2("moe", ep).generate(ps, params)
    for a, b in zip(outs, one):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].routed_experts.shape == (len(a.prompt_token_ids) + NEW - 1, 3, 2)
        assert (a.outputs[0].routed_experts == b.outputs[0].routed_experts).all()
