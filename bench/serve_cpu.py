"""Where the CPU of a burst of streams goes: `python -m bench.serve_cpu [--streams 32] [--tokens 64] [--rounds 12]`
(Linux: reads /proc). Starts `livemoe serve` on the tiny model as bench_serve does, sends bursts of
streaming requests with bench_serve's lean client, alternating with the same burst on AsyncLLM called directly,
and prints per burst (medians over the rounds): wall time, the CPU of the client (this process), the API server
and the engine core (every thread, from schedstat), and the median TTFT. When the three processes' CPU adds up to
about the wall time, they shared about one core: a burst's TTFT is then bounded by their summed work, whatever each
one's own speed. `--spy FILE` also records the API server with py-spy (GIL holder only, raw format) for
per-phase shares.
"""
import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # tiny_tokenizer
from bench.bench_serve import ENGINE_OPTIONS, SERVED_NAME, direct, server_flags, sse_stream  # noqa: E402
from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.server import ServerProcess  # noqa: E402
from tiny_tokenizer import make_text_checkpoint  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """CPU time of all the process's threads (schedstat: nanoseconds, unlike /proc/PID/stat's ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total / 1e9


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.serve_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--spy", default=None, help="py-spy raw output file for the API server (needs py-spy)")
    args = p.parse_args(argv)
    for name in ("streams", "tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    n, tokens, me = args.streams, args.tokens, os.getpid()
    path, _ = make_text_checkpoint(os.path.join(tempfile.mkdtemp(), "tiny"), moe=True)
    engine = AsyncLLM(path, dtype=torch.float32, device="cpu", use_tqdm=False, **ENGINE_OPTIONS)
    rows = {"server": [], "direct": []}
    with ServerProcess(path, SERVED_NAME, server_flags("cpu"), env={"OMP_NUM_THREADS": "1"}) as server:
        api = server.proc.pid
        cores = children(api)
        for _ in range(3):  # first-call costs
            asyncio.run(sse_stream(server.host, server.port, n, tokens))
            asyncio.run(direct(engine, n, tokens))
        spy = None
        if args.spy:
            beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # a venv's, else PATH's
            spy = subprocess.Popen([beside if os.path.exists(beside) else "py-spy", "record", "-p", str(api), "-r", "500", "-f", "raw", "-o", args.spy,
                                    "--nonblocking", "--gil", "--threads"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
            time.sleep(1.5)
        for _ in range(args.rounds):
            before = (cpu_seconds(me), cpu_seconds(api), sum(map(cpu_seconds, cores)), time.perf_counter())
            streams = asyncio.run(sse_stream(server.host, server.port, n, tokens))
            after = (cpu_seconds(me), cpu_seconds(api), sum(map(cpu_seconds, cores)), time.perf_counter())
            rows["server"].append([b - a for a, b in zip(before, after)] + [statistics.median(s.ttft for s in streams)])
            before = (cpu_seconds(me), time.perf_counter())
            streams = asyncio.run(direct(engine, n, tokens))
            after = (cpu_seconds(me), time.perf_counter())
            rows["direct"].append([b - a for a, b in zip(before, after)] + [statistics.median(s.ttft for s in streams)])
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
    engine.shutdown()

    def ms(rows, i):
        return 1e3 * statistics.median(r[i] for r in rows)

    s, d = rows["server"], rows["direct"]
    print(f"{n} streams x {tokens} tokens, medians of {args.rounds} bursts")
    print(f"server: wall {ms(s, 3):.1f} ms; CPU ms: client {ms(s, 0):.1f}, API server {ms(s, 1):.1f} "
          f"({ms(s, 1) / n:.3f} per request), engine core {ms(s, 2):.1f}; TTFT p50 {ms(s, 4):.1f} ms")
    print(f"direct: wall {ms(d, 1):.1f} ms; CPU ms (caller and engine thread, one process) {ms(d, 0):.1f}; "
          f"TTFT p50 {ms(d, 2):.1f} ms")


if __name__ == "__main__":
    main()
