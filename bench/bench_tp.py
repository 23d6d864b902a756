"""Tensor / expert-parallel decode (livemoe/engine/decoder/workers.py): what the ranks cost.

CPU (gloo): decode throughput of `LLM(tensor_parallel_size=2)` against one process on the same MoE
checkpoint, in the same run (kind "overhead": the 2-core CPU shows the cost of the worker process and
the per-step plan, not a speed-up), and the plan's transport alone (encode, ZeroMQ send to a worker
socket, receive, decode) per decode step of 64 sequences. quick: the tiny MoE; full: the small MoE of
bench_decode.
GPU: a Qwen3-30B-A3B-shaped checkpoint (its layer shapes, NUM_LAYERS layers: the per-layer costs and
collectives scale with the layer count; random bf16 weights written once) at TP 1, 2, 4 and with EP,
batch 1 and 64: ms per decode step, and the share of the step spent in collectives on rank 0 (a second,
eager run with torch.distributed's collectives timed, synchronised). A case needing more GPUs than are
visible skips, saying so (one H200 runs the TP 1 rows only).
"""
import time

import pytest
import torch

from bench.common import record

SUITE = "tensor parallel"
NUM_LAYERS = 4  # of Qwen3-30B-A3B's 48, for the GPU checkpoint


def _throughput(llm, prompts, params, reps: int = 3) -> float:
    """Output tokens per second, the best of reps runs after a warm-up (the shared host is noisy)."""
    llm.generate(prompts, params)  # warm-up
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    return best


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU suite; the GPU suite is test_tp_decode_gpu")
def test_tp_decode_cpu(benchmark, bench_mode, tmp_path_factory, one_thread):
    from bench.bench_decode import MODELS, random_prompts
    from livemoe.engine.llm import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from tiny_models import make_checkpoint

    name = "small MoE" if bench_mode == "full" else "tiny MoE"
    path, _ = make_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", moe=True, **MODELS[name])
    num, new = (32, 32) if bench_mode == "full" else (8, 16)
    prompts = random_prompts(num, 8, 32, 131 if name == "tiny MoE" else 4096)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    opts = dict(dtype=torch.float32, device="cpu", use_tqdm=False, threads=1, num_kv_blocks=512)
    one = _throughput(LLM(path, **opts), prompts, params)
    llm = LLM(path, tensor_parallel_size=2, **opts)
    try:
        box = {}
        benchmark.pedantic(lambda: box.setdefault("tp2", _throughput(llm, prompts, params)), rounds=1, iterations=1)
    finally:
        llm.close()
    record(suite=SUITE, case=f"{name}, {num} requests x {new} tokens, TP 2 vs 1 process (CPU, gloo)", metric="tok/s",
           ours=box["tp2"], baseline=one, baseline_name="tensor_parallel_size=1", higher_is_better=True,
           kind="overhead")
    record(suite=SUITE, case="step plan over ZeroMQ, decode of 64 sequences (CPU)", metric="us/step",
           ours=plan_transport_us(64), kind="overhead")


def plan_transport_us(batch: int, steps: int = 2000) -> float:
    """Encode a decode step's plan, send it on a PUSH socket, receive and decode it: microseconds per step."""
    import array

    import zmq

    from livemoe.engine.decoder.step_plan import StepPlan

    width = 64  # block-table columns: 1k tokens of context at block size 16
    plan = StepPlan(longs=array.array("q", range(3 * batch)), ints=array.array("i", range(batch * (2 + width) + 1)),
                    sample_rows=list(range(batch)), num_seqs=batch, width=width, max_seqlen_q=1, is_decode=True,
                    max_context_len=1024)
    ctx = zmq.Context(1)
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull.connect(f"tcp://127.0.0.1:{port}")
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            push.send_multipart([b"S", *plan.frames()], copy=False)
            frames = pull.recv_multipart(copy=False)
            got = StepPlan.from_frames([f.buffer for f in frames[1:]])
        elapsed = time.perf_counter() - t0
        assert got.longs == plan.longs and got.ints == plan.ints and got.sample_rows == plan.sample_rows
        return elapsed / steps * 1e6
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


# -- GPU ------------------------------------------------------------------------------------------------

GPU_LAYOUTS = [(1, False), (2, False), (4, False), (2, True), (4, True)]


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    from livemoe.engine.model.flops import resolve_config
    from livemoe.engine.model.loader import init_model
    from livemoe.engine.model.saver import save_model

    cfg = resolve_config("qwen3-30b-a3b")
    cfg.num_hidden_layers = NUM_LAYERS
    model = init_model(cfg, dtype=torch.bfloat16, device="cuda")
    path = str(tmp_path_factory.mktemp("tp-gpu") / "qwen3-30b-a3b-shape")
    save_model(model, path)
    del model
    torch.cuda.empty_cache()
    return path


class _CollectiveTimer:
    """torch.distributed's collectives on rank 0 wrapped with synchronised timers (eager runs only)."""
    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather", "all_to_all_single", "reduce_scatter_tensor")

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.seconds, self.saved = dist, 0.0, {}
        for name in self.NAMES:
            if hasattr(dist, name):
                self.saved[name] = fn = getattr(dist, name)
                setattr(dist, name, self._timed(fn))

    def _timed(self, fn):
        def call(*args, **kwargs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            self.seconds += time.perf_counter() - t0
            return out
        return call

    def restore(self):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def _ms_per_step(llm, prompts, new: int) -> float:
    """Decode time per step: (generate N tokens - generate 1) / (N - 1), prefill excluded."""
    from livemoe.engine.sampling.params import SamplingParams

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(4)  # warm-up: kernels and CUDA graphs
    return (run(new) - run(1)) / (new - 1) * 1e3


@pytest.mark.gpu
@pytest.mark.parametrize("tp,ep", GPU_LAYOUTS, ids=[f"tp{t}{'-ep' if e else ''}" for t, e in GPU_LAYOUTS])
def test_tp_decode_gpu(benchmark, bench_mode, gpu_checkpoint, tp, ep):
    from bench.bench_decode import random_prompts
    from livemoe.engine.llm import LLM

    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP {tp} needs {tp} CUDA GPUs; {torch.cuda.device_count()} visible")
    new = 16 if bench_mode == "quick" else 64
    opts = dict(tensor_parallel_size=tp, enable_expert_parallel=ep, dtype=torch.bfloat16, max_num_seqs=64,
                max_model_len=1024, use_tqdm=False, gpu_memory_utilization=0.85)
    layout = f"TP {tp}" + (" + EP" if ep else "")
    for eager in (False, True) if tp > 1 else (False,):  # the eager pass times collectives: TP 1 has none
        llm = LLM(gpu_checkpoint, enforce_eager=eager, **opts)
        try:
            for batch in (1, 64):
                prompts = random_prompts(batch, 512, 512, 151936, seed=batch)
                if eager:
                    timer = _CollectiveTimer()
                    try:
                        t0, start = time.perf_counter(), timer.seconds
                        steps_ms = _ms_per_step(llm, prompts, new)
                        share = (timer.seconds - start) / (time.perf_counter() - t0)
                    finally:
                        timer.restore()
                    record(suite=SUITE, case=f"Qwen3-30B-A3B shape ({NUM_LAYERS} layers) bf16, {layout}, batch {batch}, "
                           "eager", metric="collective share", ours=share, extra={"ms_per_step_eager": steps_ms})
                    continue
                box = {}
                fn = lambda: box.setdefault("ms", _ms_per_step(llm, prompts, new))  # noqa: E731
                if batch == 1:
                    benchmark.pedantic(fn, rounds=1, iterations=1)
                else:
                    fn()
                record(suite=SUITE, case=f"Qwen3-30B-A3B shape ({NUM_LAYERS} layers) bf16, {layout}, batch {batch}",
                       metric="ms/step", ours=box["ms"],
                       extra={"eager_fallbacks": llm.stats()["num_eager_fallbacks"]})
        finally:
            llm.close()
            torch.cuda.empty_cache()
