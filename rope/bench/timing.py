"""Timers for asynchronous GPU work, and for the host cost of an eager call.

GPU time (`gpu_time`): the calls are captured in a CUDA graph, several per graph so the replay's
own launch is amortized, and each replay is bracketed by CUDA events. Before the timed replays the
stream is given a spin kernel, so the host has queued every replay before the GPU reaches the
first one: the events then measure the GPU alone, never a GPU waiting for the host. The result
is the median over replays, per call. Calls rotate over the input sets they are given, so a
tensor that fits in L2 is not simply re-read from it. Work that cannot be captured (it reads
device values on the host, say) falls back to events around eager calls, which then include
whatever the host adds; the result says which method was used.

Host cost (`host_time`): N back-to-back eager calls between two host clock reads, with no
synchronization inside (subtracting nothing), then one synchronization outside the timed part.
That is the dispatch cost a training loop pays per call as long as the GPU keeps up. If a call's
GPU time exceeds its host time the launch queue backs up and this measures the GPU instead, so
host cost is reported for launch-bound (small) shapes, and N stays far below the queue depth.

On a CPU-only machine (the smoke run under Triton's interpreter) both fall back to host clocks.
"""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Budget:
    """How hard to try per measurement. The defaults keep the full CLI run within minutes."""

    warmup: int = 3  # eager calls per input set before anything is timed (compilation, autotuning)
    target_ms: float = 25.0  # timed GPU work per measurement
    replay_us: float = 400.0  # aim for one graph replay: amortizes the replay launch
    max_calls: int = 64  # calls captured per graph
    min_reps: int = 10
    max_reps: int = 200
    host_calls: int = 100  # eager calls per host round; far below the CUDA launch queue depth
    host_rounds: int = 15  # rounds per host measurement (host_ratio: of each of its two callables)
    host_round_ms: float = 20.0  # cap on one host round, for slow (Python-bound) implementations
    copy_bytes: int = 1 << 30


# The CPU smoke run checks the plumbing, not the numbers: one of everything.
SMOKE_BUDGET = Budget(warmup=1, target_ms=0.0, replay_us=0.0, max_calls=1, min_reps=1, max_reps=1,
                      host_calls=1, host_rounds=1, host_round_ms=0.0, copy_bytes=8 << 20)


@dataclass
class Timing:
    us: float  # median per call, microseconds
    q1: float
    q3: float
    method: str  # "graph", "events" (eager calls between CUDA events) or "host" (host clock)
    reps: int
    calls: int  # calls per timed repetition
    note: str = ""

    def as_dict(self):
        return asdict(self)


def _summary(per_call_us, method, calls, note=""):
    vals = sorted(per_call_us)
    if len(vals) >= 2:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    else:
        q1 = q3 = vals[0]
    return Timing(statistics.median(vals), q1, q3, method, len(vals), calls, note)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spin():
    """Keep the GPU busy ~10-20 ms so the host can queue the timed work ahead of it."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(20_000_000)  # cycles; 10-20 ms at today's clocks, more than queueing 200 replays takes


def _clamp(v, lo, hi):
    return max(lo, min(hi, v))


def _grad_mode(no_grad: bool):
    return torch.no_grad() if no_grad else contextlib.nullcontext()


def gpu_time(build, device, budget: Budget = Budget(), no_grad=False, graph=True) -> Timing:
    """Median GPU time per call of the callables `build()` returns (one per input set).

    `build` runs on the stream that is timed, so autograd records the forward there and a
    captured backward lands on the same stream. Everything runs under no_grad if asked.
    """
    device = torch.device(device)
    if device.type != "cuda":
        with _grad_mode(no_grad):
            return _host_clock_time(build(), budget)
    stream = torch.cuda.Stream(device)
    caller = torch.cuda.current_stream(device)
    # The inputs were written on the caller's stream: the timed stream must not read them early.
    stream.wait_stream(caller)
    with torch.cuda.device(device), _grad_mode(no_grad):
        try:
            with torch.cuda.stream(stream):
                fns = build()
                for _ in range(budget.warmup):
                    for fn in fns:
                        fn()
            stream.synchronize()
            per_call = _estimate_us(fns, stream)
            calls = int(_clamp(math.ceil(budget.replay_us / max(per_call, 1e-3)), 1, budget.max_calls))
            note = ""
            if graph:
                try:
                    return _graph_time(fns, stream, calls, budget)
                except Exception as exc:  # not capturable: fall back to eager calls between events
                    note = f"graph capture failed ({type(exc).__name__}: {_first_line(exc)})"
                    # A failed capture can leave the capture stream current; put the caller's back.
                    torch.cuda.set_stream(caller)
                    with contextlib.suppress(Exception):
                        torch.cuda.synchronize(device)
            return _event_time(fns, stream, calls, budget, note or "not capturable")
        finally:
            # Tensors made on the timed stream may be freed and reused on the caller's stream next.
            caller.wait_stream(stream)


def _first_line(exc) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:120] if text else ""


def _estimate_us(fns, stream):
    """GPU time of one eager call (median over the sets), to size the graph.

    Behind a spin kernel the host queues the calls before the GPU runs them, so a launch-bound
    call shows its GPU time, not its host time: every implementation of a small case, and its
    clone, then gets the same number of calls per graph and the same share of the replay's cost.
    """
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
    with torch.cuda.stream(stream):
        _spin()
        for (a, b), fn in zip(pairs, fns, strict=True):
            a.record()
            fn()
            b.record()
    stream.synchronize()
    return statistics.median(a.elapsed_time(b) * 1000.0 for a, b in pairs)


def _graph_time(fns, stream, calls, budget):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for i in range(calls):
            fns[i % len(fns)]()
    try:
        with torch.cuda.stream(stream):
            g.replay()  # the first replay uploads the graph
        return _repeat_timed(g.replay, stream, calls, budget, "graph", spin=True)
    finally:
        del g


def _event_time(fns, stream, calls, budget, note):
    def run():
        for i in range(calls):
            fns[i % len(fns)]()

    return _repeat_timed(run, stream, calls, budget, "events", spin=False, note=note)


def _repeat_timed(run, stream, calls, budget, method, spin, note=""):
    """Time `run` (which makes `calls` calls) between events, repeated to fill the time budget."""
    with torch.cuda.stream(stream):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
    b.synchronize()
    one = max(a.elapsed_time(b) * 1000.0, 1e-3)
    reps = int(_clamp(budget.target_ms * 1000.0 / one, budget.min_reps, budget.max_reps))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    with torch.cuda.stream(stream):
        if spin:
            _spin()
        for s, e in zip(starts, ends, strict=True):
            s.record()
            run()
            e.record()
    stream.synchronize()
    per_call = [s.elapsed_time(e) * 1000.0 / calls for s, e in zip(starts, ends, strict=True)]
    return _summary(per_call, method, calls, note)


def _host_clock_time(fns, budget):
    """CPU-only machines: the work is synchronous, so the host clock is the timer."""
    for _ in range(budget.warmup):
        for fn in fns:
            fn()
    t0 = time.perf_counter()
    fns[0]()
    one = max((time.perf_counter() - t0) * 1e6, 1e-3)
    calls = int(_clamp(math.ceil(budget.replay_us / one), 1, budget.max_calls))
    reps = int(_clamp(budget.target_ms * 1000.0 / (one * calls), budget.min_reps, budget.max_reps))
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
    return _summary(per_call, "host", calls)


def _host_round(fn, calls, no_grad, device) -> float:
    """µs per call of `calls` back-to-back calls, no sync inside; the queue is drained after."""
    with _grad_mode(no_grad):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        us = (time.perf_counter() - t0) * 1e6 / calls
    _sync(device)  # outside the timed part: drains the queue between rounds
    return us


def _host_calls(fn, device, budget, no_grad) -> int:
    """Warm `fn` up and choose the calls per round (within the round's time cap)."""
    with _grad_mode(no_grad):
        for _ in range(budget.warmup):
            fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        one = max((time.perf_counter() - t0) * 1e6, 1e-3)
    _sync(device)
    return int(_clamp(budget.host_round_ms * 1000.0 / one, 1, budget.host_calls))


@contextlib.contextmanager
def _no_gc():
    was_enabled = gc.isenabled()
    gc.disable()  # a collection inside a round would be charged to the calls
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def host_time(fn, device, budget: Budget = Budget(), no_grad=False) -> Timing:
    """Host cost of one eager call: back-to-back calls between two clock reads, no sync inside."""
    device = torch.device(device)
    calls = _host_calls(fn, device, budget, no_grad)
    with _no_gc():
        per_call = [_host_round(fn, calls, no_grad, device) for _ in range(budget.host_rounds)]
    return _summary(per_call, "host", calls)


def host_ratio(fn, ref, device, budget: Budget = Budget(), no_grad=False):
    """(Timing of `fn`, Timing of `ref`, ratio): host costs as `host_time` measures them, in rounds
    that alternate between `fn` and `ref` (`ref` under no_grad: clone of the same tensor), and the
    median over pairs of rounds of fn's µs per call over ref's in the same pair. Host load drifts
    between measurements made apart (on the H200's shared host, clone's own cost was 7.3 µs for one
    case and 12.0 for the next in one run: BENCHMARKS.md); the two rounds of a pair share it."""
    device = torch.device(device)
    n_fn = _host_calls(fn, device, budget, no_grad)
    n_ref = _host_calls(ref, device, budget, True)
    mine, theirs = [], []
    runs = [(fn, n_fn, no_grad, mine), (ref, n_ref, True, theirs)]
    with _no_gc():
        for i in range(budget.host_rounds):
            for f, calls, ng, out in (runs[::-1] if i % 2 else runs):  # which goes first alternates
                out.append(_host_round(f, calls, ng, device))
    ratio = statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
    return _summary(mine, "host", n_fn), _summary(theirs, "host", n_ref), ratio


def cuda_sync_clock() -> float:
    """A synchronizing clock for host-side timers (pytest-benchmark): waits for the GPU, then reads."""
    torch.cuda.synchronize()
    return time.perf_counter()


def copy_bandwidth(device, budget: Budget = Budget()):
    """GB/s of a large device-to-device copy, bytes read plus bytes written: the roofline."""
    device = torch.device(device)
    n = budget.copy_bytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_(-1.0, 1.0)
    dst = torch.empty_like(src)
    # Eager calls between events, not graph replay: a captured copy_ becomes a memcpy node that the
    # copy engines run (about 2.7 TB/s on an H200), while an eager copy_ runs as a kernel at the
    # bandwidth a kernel can reach (about 4.2 TB/s there), which is the roofline a kernel is held to.
    timing = gpu_time(lambda: [lambda: dst.copy_(src)], device, budget, no_grad=True, graph=False)
    return 2 * n * 4 / (timing.us * 1e-6) / 1e9, timing


def l2_bytes(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
