"""pytest-benchmark suite: `pytest --benchmark-only benchmarks/` on a CUDA machine.

Forward, backward and forward+backward are separate benchmarks for `rope` and the eager PyTorch
reference on every case of `rope.bench.shapes` (ROPE_BENCH_QUICK=1 for the --quick subset,
ROPE_BENCH_SHAPES=name,... for chosen ones), plus `torch.clone` of the same tensor as the floor.
The large q/k case (Llama GQA) compares `ours_qk` (one apply_rotary_pos_emb_qk call) with `ours_2x`
(two apply_rotary_pos_emb calls), forward and backward, with clone of q and k as the floor:
`pytest --benchmark-only benchmarks -k qk`. The other q/k cases run only when named in
ROPE_BENCH_SHAPES. The in-place case times `ours_inplace` forward (repeated rotations of one
buffer under no_grad).

Timing: pytest-benchmark's clock is replaced by one that synchronizes the GPU before reading the
host clock, so a round is N back-to-back eager calls bracketed by two synchronizations: the time
per call includes the GPU work and, where it is larger, the host's dispatch. N is chosen so a
round lasts a few ms, which makes the synchronization itself negligible. Warm-up rounds run
first, so Triton compilation and first-call costs stay out. For launch-bound shapes this is the
host's cost, not the GPU's; `extra_info` also carries the GPU time from CUDA-graph replay (median)
and the GB/s and fraction of the copy bandwidth from both. `python -m rope.bench` is the fuller
comparison (torch.compile and other libraries, host cost against clone, targets, plots).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from rope.bench.checks import check_impl, reference64
from rope.bench.inputs import leaf, make_inputs, parts, sets_for
from rope.bench.peers import make_impls
from rope.bench.shapes import select
from rope.bench.timing import Budget, cuda_sync_clock, gpu_time, l2_bytes

try:
    import pytest_benchmark  # noqa: F401

    HAS_PLUGIN = True
except ImportError:
    HAS_PLUGIN = False

HAS_CUDA = torch.cuda.is_available()

pytestmark = [
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: on CPU only Triton's interpreter would be timed "
                                            "(tests/test_bench_cli.py smoke-tests the harness on CPU)"),
    pytest.mark.skipif(not HAS_PLUGIN, reason="needs pytest-benchmark (the project's `bench` extra)"),
    pytest.mark.benchmark(timer=cuda_sync_clock, disable_gc=True),
]

_NAMED = [n for n in os.environ.get("ROPE_BENCH_SHAPES", "").split(",") if n]
CASES = select(_NAMED or None, quick=os.environ.get("ROPE_BENCH_QUICK") == "1")
IMPLS = {impl.name: impl for impl in make_impls(["ours", "reference", "ours_qk", "ours_2x", "ours_inplace"])}
MODES = ("fwd", "bwd", "fwd+bwd")


def _benchmarks(case):
    """(impl, mode) pairs for a case, by its kind; clone first as the floor."""
    if case.kind == "qk":
        if not (_NAMED or "qk_headline" in case.tags):
            return []
        return [("clone", "fwd")] + [(i, m) for i in ("ours_qk", "ours_2x") for m in ("fwd", "bwd")]
    if case.kind == "inplace":
        return [("clone", "fwd"), ("ours_inplace", "fwd")]
    return [("clone", "fwd")] + [(i, m) for i in ("ours", "reference") for m in MODES]


# Case outermost, so one case's tensors are alive at a time.
PARAMS = [(c, i, m) for c in CASES for i, m in _benchmarks(c)]

ROUND_S = 0.003  # one round: a few ms of calls, so the two synchronizations are noise
BENCH_S = 0.2  # timed rounds per benchmark
GRAPH_BUDGET = Budget(target_ms=10.0)


class _Current:
    """The inputs, float64 reference and check results of the case being benchmarked."""

    name = None
    inputs = None
    ref = None
    checks: dict = {}


def _case_state(case):
    if _Current.name != case.name:
        _Current.inputs = _Current.ref = None
        torch.cuda.empty_cache()
        inputs = make_inputs(case, "cuda", sets_for(case, torch.device("cuda"), l2_bytes("cuda")), seed=1)
        _Current.name, _Current.inputs, _Current.checks = case.name, inputs, {}
        _Current.ref = reference64(inputs, inputs.ts[0], inputs.gs[0])
    return _Current


def _calls(impl, inputs, mode):
    """(zero-arg callables, one per input set) for a mode; forward-only runs under no_grad."""
    fns = []
    for t, g in zip(inputs.ts, inputs.gs, strict=True):
        if mode == "fwd":
            b = impl.bind(inputs, t)

            def fn(b=b):
                with torch.no_grad():
                    return b.fn(*b.xs)
        elif mode == "bwd":
            b = impl.bind(inputs, leaf(t), g)
            outs = b.fn(*b.xs)

            def fn(b=b, outs=outs):
                return torch.autograd.grad(outs, b.xs, b.gs, retain_graph=True)
        else:
            b = impl.bind(inputs, leaf(t), g)

            def fn(b=b):
                return torch.autograd.grad(b.fn(*b.xs), b.xs, b.gs)
        fns.append(fn)
    return fns


def _rotating(fns):
    state = [0]

    def call():
        fns[state[0]]()
        state[0] = (state[0] + 1) % len(fns)

    return call


def _plan(target):
    """Iterations per round and rounds, from one synchronized call after a warm-up."""
    for _ in range(3):
        target()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    target()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    iterations = int(min(max(ROUND_S / one, 1), 500))
    rounds = int(min(max(BENCH_S / (one * iterations), 5), 50))
    return iterations, rounds


@pytest.mark.parametrize(("case", "impl_name", "mode"), PARAMS,
                         ids=[f"{c.name}-{i}-{m}" for c, i, m in PARAMS])
def test_rope(benchmark, copy_gbps, case, impl_name, mode):
    state = _case_state(case)
    inputs = state.inputs
    benchmark.group = f"{case.name}: {case.label} {case.dtype} {case.fmt}"
    info = benchmark.extra_info
    info.update(case=case.name, shape=list(case.shape), label=case.label, dtype=case.dtype, format=case.fmt,
                rot_dim=case.d2, interleaved=case.interleaved, impl=impl_name, mode=mode, copy_gbps=copy_gbps)
    if case.hk:
        info.update(k_shape=list(case.shapes[1]), k_heads=case.hk)
    if case.inplace:
        info.update(inplace=True, note="repeated in-place rotations of one buffer: values change, work does not")

    if impl_name == "clone":
        if case.hk:  # q and k: both cloned, two launches
            fns = [lambda t=t: [x.clone() for x in parts(t)] for t in inputs.ts]
        else:
            fns = [lambda t=t: t.clone() for t in inputs.ts]
        nbytes = 2 * case.numel * case.elem_bytes
        graph_fns = lambda: fns  # noqa: E731
        safe = True
    else:
        impl = IMPLS[impl_name]
        why = impl.missing() or impl.unsupported(case)
        if why:
            pytest.skip(why)
        if impl_name not in state.checks:
            state.checks[impl_name] = check_impl(impl, inputs, inputs.ts[0], inputs.gs[0], state.ref)
        chk = state.checks[impl_name]
        info.update(fwd_rel_err=chk.fwd_err, bwd_rel_err=chk.bwd_err)
        assert chk.ok, f"{impl_name} disagrees with float64 on {case.name}: {chk.message}"
        fns = _calls(impl, inputs, mode)
        nbytes = {"fwd": case.bytes_fwd, "bwd": case.bytes_bwd, "fwd+bwd": case.bytes_fwd + case.bytes_bwd}[mode]
        graph_fns = lambda: _calls(impl, inputs, mode)  # noqa: E731
        safe = impl.bind(inputs, inputs.ts[0]).graph_safe

    target = _rotating(fns)
    iterations, rounds = _plan(target)
    benchmark.pedantic(target, iterations=iterations, rounds=rounds, warmup_rounds=2)

    if benchmark.stats is None:  # --benchmark-disable: the target ran once, nothing was timed
        return
    median = benchmark.stats.stats.median  # seconds per call
    gbps = nbytes / median / 1e9
    info.update(bytes=nbytes, us_per_call=median * 1e6, gbps=gbps, frac_copy=gbps / copy_gbps,
                timer="cuda synchronize + perf_counter around back-to-back eager calls")
    g = gpu_time(graph_fns, "cuda", GRAPH_BUDGET, graph=safe)
    g_gbps = nbytes / (g.us * 1e-6) / 1e9
    info.update(gpu_us=g.us, gpu_method=g.method, gpu_gbps=g_gbps, gpu_frac_copy=g_gbps / copy_gbps)
