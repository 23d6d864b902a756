"""What every benchmark suite shares: timing, peak memory, and the results writer.

A suite times our op and its baseline in the same process (this machine is noisy: ratios, not
absolute figures, are what a CPU run can claim) and records one row per case with `record(...)`.
The rows land in $LIVEMOE_BENCH_OUT (default bench/out)/results.{json,md} as they are recorded, and again
with a PNG chart at the end of the session.
"""
import ctypes
import gc
import json
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

OUT_DIR = os.environ.get("LIVEMOE_BENCH_OUT", os.path.join(os.path.dirname(__file__), "out"))
ROWS: list["Row"] = []


@dataclass
class Row:
    suite: str
    case: str
    metric: str  # what `ours` and `baseline` measure, e.g. "ms", "MiB", "tok/s"
    ours: float
    baseline: float | None = None
    baseline_name: str = ""
    higher_is_better: bool = False
    floor: float | None = None  # the hardware bound for this case, same unit (GPU only)
    model: float | None = None  # the roofline model's time for this case (bench/roofline.py), same unit (GPU only)
    extra: dict = field(default_factory=dict)
    # what the baseline comparison means: "speedup" (ours against another implementation), "overhead" (a
    # layer of ours against the same work without it: ours is the cost) or "reproduction" (our figure
    # against a published one: the closer to 1, the better)
    kind: str = "speedup"

    def __post_init__(self):
        assert self.kind in ("speedup", "overhead", "reproduction"), self.kind

    @property
    def speedup(self) -> float | None:
        """>1 means ours is better, whatever the metric's direction."""
        if self.baseline is None or self.ours == 0 or self.baseline == 0:
            return None
        return self.ours / self.baseline if self.higher_is_better else self.baseline / self.ours

    @property
    def reading(self) -> str:
        """The comparison in words, as its kind reads."""
        if self.speedup is None:
            return ""
        if self.kind == "overhead":
            return f"{100 * (1 / self.speedup - 1):+.0f}% cost"
        if self.kind == "reproduction":
            return f"{self.ours / self.baseline:.3f} of it ({100 * (self.ours / self.baseline - 1):+.1f}%)"
        return f"{self.speedup:.2f}x better" if self.speedup >= 1 else f"{1 / self.speedup:.2f}x worse"


def record(**kw) -> Row:
    """Adds a row, and rewrites results.{json,md} at once ("partial" until the session's end rewrites them): a
    run killed by a time limit (bench/gpu_check.sh on a lent GPU) still leaves every figure measured so far."""
    row = Row(**kw)
    ROWS.append(row)
    _write_tables("partial")
    return row


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_pair(ours, baseline, reps: int):
    """ours() and baseline() each time themselves and return (seconds, result); they run alternately, `reps`
    times each, so drift on a noisy machine hits both alike. Returns (median seconds of ours, its last result,
    median seconds of the baseline, its last result)."""
    runs: tuple[list, list] = ([], [])
    for _ in range(reps):
        runs[0].append(ours())
        runs[1].append(baseline())
    (t_ours, r_ours), (t_base, r_base) = ([statistics.median(t for t, _ in side), side[-1][1]] for side in runs)
    return t_ours, r_ours, t_base, r_base


def median_times(ours, baseline, reps: int) -> tuple[float, float]:
    """median_pair for ours() and baseline() that return their seconds alone: (median of ours, of the baseline)."""
    t_ours, _, t_base, _ = median_pair(lambda: (ours(), None), lambda: (baseline(), None), reps)
    return t_ours, t_base


def play_live(sessions: list, events, warm: int, timed: int) -> tuple:
    """(seconds per timed interval, (mean prompt, cached prompt, completion tokens) per decision) of live sessions
    played together (livemoe.engine.live.step_sessions): interval i brings each session events(i); `warm`
    intervals untimed, then `timed`. Closes the sessions."""
    from livemoe.engine.live import step_sessions

    llm = sessions[0].llm
    for i in range(warm):
        step_sessions(llm, [(s, events(i)) for s in sessions])
    t0 = time.perf_counter()
    decisions = []
    for i in range(warm, warm + timed):
        decisions += step_sessions(llm, [(s, events(i)) for s in sessions])
    dt = (time.perf_counter() - t0) / timed
    for s in sessions:
        s.close()
    n = len(decisions)
    return dt, tuple(sum(getattr(d.metrics, k) for d in decisions) / n
                     for k in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens"))


def measure(fn, device="cpu", warmup: int = 1, reps: int = 5) -> float:
    """Median time of fn() in seconds: wall time on the CPU; on CUDA the stream's time between events around
    each call (no host sync between calls, whose cost would inflate a short kernel's figure)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if torch.device(device).type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def peak_memory(fn, device="cpu") -> int | None:
    """Peak bytes allocated while fn() runs, above what was allocated before. CUDA: the allocator's peak.
    CPU (Linux): the peak resident set, reset through /proc/self/clear_refs; None where that is not
    possible. (torch's profiler memory events miss most CPU allocations, so they are not used.)"""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _peak_rss(fn)


def _peak_rss(fn) -> int | None:
    def status(key):
        with open("/proc/self/status") as f:
            return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    # glibc keeps freed blocks of up to 32 MiB in its heap and reuses them without touching new pages;
    # with a fixed 64 KiB mmap threshold every tensor gets (and returns) its own pages, so the peak
    # resident set counts each allocation
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    try:
        libc.malloc_trim(0)  # hand back the free heap, so that reuse of it shows as new pages too
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        base = status("VmRSS")
        fn()
        return status("VmHWM") - base
    except OSError:
        return None
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
           "cpu_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def _write_tables(mode: str) -> list[str]:
    """results.json and results.md from the rows so far."""
    os.makedirs(OUT_DIR, exist_ok=True)
    env = environment()
    rows = [{**asdict(r), "speedup": r.speedup} for r in ROWS]
    paths = [os.path.join(OUT_DIR, n) for n in ("results.json", "results.md")]
    with open(paths[0], "w") as f:
        json.dump({"mode": mode, "environment": env, "rows": rows}, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(f"# livemoe benchmarks ({mode} mode)\n\n")
        f.write(", ".join(f"{k} {v}" for k, v in env.items()) + "\n\n")
        f.write("| suite | case | metric | ours | baseline | vs | reads as | of floor | x model |\n")
        f.write("| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |\n")
        for r in ROWS:
            base = "" if r.baseline is None else f"{r.baseline:.4g}"
            fl = "" if r.floor is None or not r.ours else f"{(r.ours / r.floor if r.higher_is_better else r.floor / r.ours):.0%}"
            xm = "" if not r.model else f"{r.ours / r.model:.2f}x"  # measured / predicted
            f.write(f"| {r.suite} | {r.case} | {r.metric} | {r.ours:.4g} | {base} | {r.baseline_name} | {r.reading} | {fl} "
                    f"| {xm} |\n")
    return paths


def write_results(mode: str) -> list[str]:
    """The session's end: the tables with their mode, and results.png (bench.plot; where matplotlib is)."""
    if not ROWS:
        return []
    paths = _write_tables(mode)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return paths
    from bench.plot import draw_results

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    fig = draw_results(ROWS, f"livemoe benchmarks, {mode} mode, {device}, {time.strftime('%Y-%m-%d')}")
    if fig is not None:
        import matplotlib.pyplot as plt

        paths.append(os.path.join(OUT_DIR, "results.png"))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
