"""The benchmarks' host clock (importable without a GPU: the benchmark modules skip, their collection does not)."""
from __future__ import annotations

import statistics
import time

import torch


def cuda_sync_clock() -> float:
    """pytest-benchmark's timer: waits for the GPU, then reads the host clock."""
    torch.cuda.synchronize()
    return time.perf_counter()


# Same-process A/B timers (benchmarks/ab.py, benchmarks/schedules.py): CUDA-graph replay and eager calls.
def graph_us(fn, calls=50, reps=30):
    """Median µs per call of `calls` calls of fn replayed in one CUDA graph, over `reps` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(calls):
                fn()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record(s)
            g.replay()
            b.record(s)
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / calls)
    torch.cuda.current_stream().wait_stream(s)
    return statistics.median(ts)


def eager_us(fn, n=300):
    """(wall per call to the end of the GPU's work, host time per call: the loop before the final sync)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / n, host * 1e6 / n
