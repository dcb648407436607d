"""pytest-benchmark suite: `pytest --benchmark-only` on a CUDA GPU (without one the module skips).

Per case of cases.CASES: clone of the same tensor(s), the floor, then each implementation that runs
that kind of case (peers.py; peers that are not installed are left out) forward (under no_grad),
backward (the backward of one recorded forward, replayed) and both; the in-place one forward only.
Each must first agree with float64 on the case (checks.py): rope failing fails, a peer is skipped.

Eager time (pytest-benchmark's statistics): rounds of back-to-back calls between two reads of a clock
that synchronizes the GPU first (where dispatch outlasts the GPU's work, the host's cost). GPU time:
the calls captured in a CUDA graph, replayed behind a spin kernel and timed by CUDA events, median
per call (none for work that cannot be captured; rope evaluates sin/cos in the kernel under capture,
as in a user's graph). extra_info gives both as GB/s, as a fraction of the copy bandwidth (measured
once per session) and as a ratio to clone of the same case in this run; benchmarks/report.py tabulates.
"""
from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: on a CPU only Triton's interpreter would be timed", allow_module_level=True)

from cases import CASES, leaf, make_inputs, parts, sets_for  # noqa: E402
from checks import check_impl, reference64  # noqa: E402
from peers import IMPLS  # noqa: E402
from timing import cuda_sync_clock  # noqa: E402

# A round: back-to-back calls for at least 3 ms (the two synchronizations are noise), 0.2 s of rounds per benchmark
# after warm-up calls (compilation, autotuning); pytest-benchmark calibrates the calls per round.
pytestmark = pytest.mark.benchmark(timer=cuda_sync_clock, disable_gc=True, min_time=0.003, max_time=0.2, min_rounds=5,
                                   warmup=True, warmup_iterations=3)
REPLAY_US, MAX_CALLS, REPLAYS = 400.0, 64, 50  # graph: calls captured per graph, for ~400 µs at copy speed
SPIN_CYCLES = 20_000_000  # 10-20 ms of GPU spin: far longer than the host takes to queue the replays
MODES = ("fwd", "bwd", "fwd+bwd")
L2_BYTES = torch.cuda.get_device_properties(0).L2_cache_size
IMPL = {name: cls() for name, cls in IMPLS.items()}
IMPL = {name: impl for name, impl in IMPL.items() if not impl.missing()}  # conftest names the missing peers


# Case by case (one case's tensors alive at a time), clone first: the floor the others are compared with.
PARAMS = [(case, name, mode) for case in CASES for name, impl in [("clone", None), *IMPL.items()]
          if impl is None or case.kind in impl.kinds for mode in (MODES if impl and impl.backward else ("fwd",))]


@pytest.fixture(scope="session")
def copy_gbps():
    """GB/s (bytes read + written) of an eager 1 GiB device-to-device copy, median of 20 timed by CUDA events.
    Not in a graph, where copy_ becomes a memcpy node run by the copy engines, slower than an eager copy_'s kernel."""
    src = torch.empty(1 << 28, device="cuda").uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.nbytes / (_median_ms(lambda: dst.copy_(src), 20) * 1e-3) / 1e9


def _median_ms(run, reps, spin=False) -> float:
    """Median ms of `run()` between CUDA events, `reps` times on the current stream (behind a spin kernel if
    asked: the host then queues every repetition before the GPU reaches the first)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    if spin:
        torch.cuda._sleep(SPIN_CYCLES)
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


_STATE = {"case": None}  # the case being benchmarked: inputs, float64 reference, checks, clone's times


def _state(case):
    if _STATE.get("case") != case:
        _STATE.clear()
        torch.cuda.empty_cache()
        inputs = make_inputs(case, "cuda", sets_for(case, L2_BYTES), seed=CASES.index(case))
        ref = reference64(inputs, inputs.ts[0], inputs.gs[0])
        _STATE.update(case=case, inputs=inputs, ref=ref, checks={}, clone={})
    return _STATE


def _calls(impl, inputs, mode) -> list:
    """One zero-argument call per input set (clone where impl is None)."""
    fns = []
    for t, g in zip(inputs.ts, inputs.gs, strict=True):
        if impl is None:
            fns.append(lambda t=t: [x.clone() for x in parts(t)])
        elif mode == "fwd":
            b = impl.bind(inputs, t)
            fns.append(torch.no_grad()(lambda b=b: b.fn(*b.xs)))
        elif mode == "bwd":  # the forward recorded once here; each call replays its backward
            b = impl.bind(inputs, leaf(t), g)
            outs = b.fn(*b.xs)
            fns.append(lambda b=b, outs=outs: torch.autograd.grad(outs, b.xs, b.gs, retain_graph=True))
        else:
            b = impl.bind(inputs, leaf(t), g)
            fns.append(lambda b=b: torch.autograd.grad(b.fn(*b.xs), b.xs, b.gs))
    return fns


def gpu_us(build, calls) -> float:
    """Median GPU µs per call of the calls `build()` returns, `calls` of them captured in one CUDA graph.

    `build` runs on the timed stream, so autograd records the forward there and the backward runs
    there too, inside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were written on the default stream
    with torch.cuda.stream(stream):
        fns = build()
        for _ in range(3):  # warm-up outside the capture (allocator, autograd, lazy initialization)
            for fn in fns:
                fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fns[i % len(fns)]()
        graph.replay()  # the first replay uploads the graph
        ms = _median_ms(graph.replay, REPLAYS, spin=True)
    torch.cuda.current_stream().wait_stream(stream)  # what was made on the timed stream may be reused after
    return ms * 1e3 / calls


def rates(nbytes: int, us: float, gpu: float | None, clone: dict, copy_gbps: float) -> dict:
    """extra_info's rates of a benchmark: GB/s, fraction of copy and ratio to clone (of the same case, this run),
    eager (`us`) and in a graph (`gpu`, None where not captured)."""
    def ratio(a, b):
        return a / b if a and b else None

    def gbps(t_us):
        return ratio(nbytes / 1e3, t_us)  # bytes per µs / 1e3

    return dict(bytes=nbytes, copy_gbps=copy_gbps, us=us, gbps=gbps(us), frac_copy=gbps(us) / copy_gbps, gpu_us=gpu,
                gpu_gbps=gbps(gpu), gpu_frac_copy=ratio(gbps(gpu), copy_gbps),
                x_clone=ratio(us, clone.get("us")), gpu_x_clone=ratio(gpu, clone.get("gpu_us")))


@pytest.mark.parametrize(("case", "impl_name", "mode"), PARAMS, ids=[f"{c.name}-{i}-{m}" for c, i, m in PARAMS])
def test_rope(benchmark, copy_gbps, case, impl_name, mode):
    state = _state(case)
    inputs, impl = state["inputs"], IMPL.get(impl_name)
    benchmark.group = f"{case.name}: {case.label}"
    info = benchmark.extra_info
    info.update(case=case.name, label=case.label, impl=impl_name, mode=mode)
    if impl is not None:
        why = impl.unsupported(case)
        if why:
            pytest.skip(f"{impl_name}: {why}")
        if impl_name not in state["checks"]:
            state["checks"][impl_name] = check_impl(impl, inputs, inputs.ts[0], inputs.gs[0], state["ref"])
        check = state["checks"][impl_name]
        if not check.ok and impl.ours:
            pytest.fail(f"{impl_name} disagrees with float64 on {case.name}: {check.message}")
        if not check.ok:
            pytest.skip(f"{impl_name} disagrees with float64 on {case.name}, not timed: {check.message}")
        info.update(fwd_rel_err=check.fwd_err, bwd_rel_err=check.bwd_err)

    sets = itertools.cycle(_calls(impl, inputs, mode))  # one call per input set, in turn

    def target():
        next(sets)()

    benchmark(target)
    if benchmark.stats is None:  # --benchmark-disable: the target ran once, nothing was timed
        return

    nbytes = 2 * case.numel * case.elem_bytes if impl is None else case.bytes_fwd * (2 if mode == "fwd+bwd" else 1)
    us = benchmark.stats.stats.median * 1e6
    gpu = None
    if impl is None or impl.capturable(case):
        calls = min(MAX_CALLS, math.ceil(REPLAY_US * copy_gbps * 1e3 / nbytes))  # nearly the same for a case's impls
        gpu = gpu_us(lambda: _calls(impl, inputs, mode), calls)
    if impl is None:
        state["clone"] = {"us": us, "gpu_us": gpu}
    clone = state["clone"]  # empty if clone of this case was deselected

    info.update(rates(nbytes, us, gpu, clone, copy_gbps))
