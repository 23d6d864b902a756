"""GRPO under torchrun: how the rollout decoder gets whole weights from the FSDP-sharded policy, measured on 2 gloo
ranks (CPU) over one rollout phase of `decode` steps of `b` sequences (one new token each):

  gathered  (livemoe.train.grpo's choice, verl's hybrid engine): after each optimizer step the shards are gathered once into
            a plain inference copy (Distributed.refresh_copy); decoding then runs on the copy with no collective
  sharded   generation through the FSDP module: every decode step's forward all-gathers every layer again

Reported per rank: the seconds of a rollout phase (gather + decode for `gathered`), their ratio, and the extra
memory (the inference copy, against the one layer + root an FSDP forward holds gathered at a time). The sharded
path also needs every rank to decode in lockstep (its all-gathers, and with expert parallel its all-to-alls, are
collectives), so ranks whose rollouts end at different lengths would have to run empty steps: the timing below
is its best case.
"""
import time

import torch

from bench.bench_parallel import Size, _model
from bench.common import record

# batch: sequences per rank; steps: decode steps of one token each (seq_len 1)
SIZES = {"quick": Size(64, 2, 8, 2, 32, 128, batch=4, seq_len=1, steps=8),
         "full": Size(256, 4, 16, 2, 128, 1024, batch=16, seq_len=1, steps=64)}


def measure(size):
    from livemoe.train.distributed import setup

    d = setup(expert_parallel=1, timeout_s=120, backend="gloo")
    b, steps = size.batch, size.steps
    model = d.parallelize(_model(size), bf16=False)
    whole = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731  (DTensor: global)
    local = sum(p.to_local().nbytes for p in model.parameters())
    layer = max(whole(layer.parameters()) for layer in model.model.layers)
    root = whole(p for n, p in model.named_parameters() if ".layers." not in n)
    copy = d.inference_copy(model, torch.float32)
    ids = torch.randint(0, size.vocab, (b, 1), generator=torch.Generator().manual_seed(d.rank))
    out = {}
    with torch.no_grad():
        for name, forward in (("sharded", model.forward_hidden), ("gathered", copy.forward_hidden)):
            forward(ids)  # warm-up
            d.barrier()
            t0 = time.perf_counter()
            if name == "gathered":
                d.refresh_copy(model, copy)  # once per optimizer step
            for _ in range(steps):
                forward(ids)
            out[name] = time.perf_counter() - t0
    out["copy_bytes"] = sum(p.nbytes for p in copy.parameters())
    out["sharded_transient_bytes"] = 2 * layer + root  # the computing layer, the prefetched one, the root unit
    out["shard_bytes"] = local
    return out


def test_bench_rollout_weights(bench_mode):
    from spawn_ranks import spawn_ranks  # tests/ is on the path (bench/conftest.py)

    size = SIZES[bench_mode]
    results = spawn_ranks(measure, 2, size, timeout=300 if bench_mode == "quick" else 1200)
    assert len(results) == 2
    sharded = max(r["sharded"] for r in results)  # a phase ends when the slowest rank's does
    gathered = max(r["gathered"] for r in results)
    r0 = results[0]
    assert sharded > 0 and gathered > 0 and r0["copy_bytes"] > r0["shard_bytes"]
    record(suite="rollout_weights", case=f"2 ranks, {size.steps} decode steps", metric="s per rollout phase",
           ours=gathered, baseline=sharded, baseline_name="through the FSDP module", higher_is_better=False,
           extra={"copy_MB": round(r0["copy_bytes"] / 1e6, 3),
                  "sharded_transient_MB": round(r0["sharded_transient_bytes"] / 1e6, 3),
                  "shard_MB": round(r0["shard_bytes"] / 1e6, 3)})
