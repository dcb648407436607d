"""pytest-benchmark suite of multimodal RoPE (Qwen2-VL's mRoPE) on a CUDA GPU (without one the module skips):

    python -m pytest benchmarks/bench_mrope.py --benchmark-only -p no:xdist --benchmark-json=bench-out/mrope.json
    python benchmarks/report.py bench-out/mrope.json --out bench-out      # table.md, plots and mrope.md

The case (mrope_peers.py): a Qwen2-VL-7B-like attention step, q 28 heads, k 4 heads, head dim 128, bf16,
mrope_section [16, 24, 24], batch 1, T tokens for T in mrope_peers.TOKENS. Per T: clone of q and k, the floor,
then each implementation of mrope_peers.IMPLS forward (under no_grad), backward (the backward of one recorded
forward, replayed, with a random upstream gradient) and both. Each must first agree with float64 on the case
(checks.check_impl against mrope_peers.reference64): rope failing fails, a peer is skipped with the error; a peer
that does not import is skipped with the reason. extra_info.source names the function hf-eager and hf-compiled ran.

Timing is bench_rope.py's, with its helpers: eager time from pytest-benchmark's rounds on a clock that
synchronizes the GPU; GPU time of the calls captured in a CUDA graph, replayed behind a spin kernel and timed by
CUDA events (a peer whose calls cannot be captured gets eager time only, the error in extra_info.capture_error).
extra_info gives both as GB/s, as a fraction of the copy bandwidth (measured once per session) and as a ratio to
clone of the same T in this run; benchmarks/report.py tabulates them (mrope.md: T x implementation x mode).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: on a CPU only Triton's interpreter would be timed", allow_module_level=True)

# bench_rope's timing: pytestmark (its clock and round settings) applies to this module's tests too, and
# copy_gbps is its session fixture, found here by name.
from bench_rope import L2_BYTES, MAX_CALLS, MODES, REPLAY_US, _calls, copy_gbps, gpu_us, pytestmark, rates  # noqa: E402, F401
from cases import sets_for  # noqa: E402
from checks import check_impl  # noqa: E402
from mrope_peers import CASES, IMPLS, make_inputs, reference64  # noqa: E402

IMPL = {name: cls() for name, cls in IMPLS.items()}

# Case by case (one T's tensors alive at a time), clone first: the floor the others are compared with.
PARAMS = [(case, name, mode) for case in CASES for name in ("clone", *IMPL)
          for mode in (MODES if name != "clone" else ("fwd",))]

_STATE = {"case": None}  # the T being benchmarked: inputs, float64 reference, checks, clone's times


def _state(case):
    if _STATE.get("case") != case:
        _STATE.clear()
        torch.cuda.empty_cache()
        inputs = make_inputs(case, "cuda", sets_for(case, L2_BYTES), seed=CASES.index(case))
        ref = reference64(inputs, inputs.ts[0], inputs.gs[0])
        _STATE.update(case=case, inputs=inputs, ref=ref, checks={}, clone={})
    return _STATE


@pytest.mark.parametrize(("case", "impl_name", "mode"), PARAMS, ids=[f"T{c.tokens}-{i}-{m}" for c, i, m in PARAMS])
def test_mrope(benchmark, copy_gbps, case, impl_name, mode):  # noqa: F811 (copy_gbps: the fixture imported above)
    impl = IMPL.get(impl_name)
    if impl is not None and impl.missing():
        pytest.skip(f"{impl_name}: not timed, {impl.missing()}")
    state = _state(case)
    inputs = state["inputs"]
    benchmark.group = f"{case.name}: {case.label}"
    info = benchmark.extra_info
    info.update(suite="mrope", tokens=case.tokens, case=case.name, label=case.label, impl=impl_name, mode=mode)
    if hasattr(impl, "source"):  # hf-eager, hf-compiled: transformers' function or its definition written out
        info["source"] = impl.source()
    if getattr(impl, "note", None):  # liger: it writes in place
        info["note"] = impl.note
    if impl is not None:
        # The bound is checks.REL_TOL's for bf16, 1e-2 of ||ref|| (relative L2 error, q and k and their gradients
        # each): 1.3 bf16 ulps (eps 2^-7). Rounding alone stays at a fifth of it or less (H100, T 16..32768):
        # 1.2-1.7e-3 for rope-packed (float32 table, one rounding to bf16), 1.4-2.1e-3 for rope-hf (bf16 cos/sin,
        # one rounding), 1.6-2.6e-3 for Liger and hf-eager (bf16 arithmetic, up to three roundings). A sign error
        # gives 0.5-1 and a wrong stream for a section 0.07-0.15 from T = 512 on; at T <= 64 the three streams
        # differ by a few positions, too little for a wrong section to show (T = 1 is position 0: exact).
        if impl_name not in state["checks"]:
            state["checks"][impl_name] = check_impl(impl, inputs, inputs.ts[0], inputs.gs[0], state["ref"])
        check = state["checks"][impl_name]
        if not check.ok and impl.ours:
            pytest.fail(f"{impl_name} disagrees with float64 on {case.name}: {check.message}")
        if not check.ok:
            pytest.skip(f"{impl_name} disagrees with float64 on {case.name}, not timed: {check.message}")
        info.update(fwd_rel_err=check.fwd_err, bwd_rel_err=check.bwd_err)

    fns = _calls(impl, inputs, mode)  # one call per input set, in turn
    for fn in fns:  # warm-up outside the timing: torch.compile's compilation, Triton's autotuning
        fn()
    torch.cuda.synchronize()
    sets = itertools.cycle(fns)

    def target():
        next(sets)()

    benchmark(target)
    if benchmark.stats is None:  # --benchmark-disable: the target ran once, nothing was timed
        return

    nbytes = 2 * case.numel * case.elem_bytes if impl is None else case.bytes_fwd * (2 if mode == "fwd+bwd" else 1)
    us = benchmark.stats.stats.median * 1e6
    gpu = None
    calls = min(MAX_CALLS, math.ceil(REPLAY_US * copy_gbps * 1e3 / nbytes))  # nearly the same for a T's impls
    try:
        gpu = gpu_us(lambda: _calls(impl, inputs, mode), calls)
    except Exception as exc:  # rope must capture; a peer that cannot is timed eagerly only
        if impl is None or impl.ours:
            raise
        info["capture_error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize()
    if impl is None:
        state["clone"] = {"us": us, "gpu_us": gpu}
    clone = state["clone"]  # empty if clone of this T was deselected

    info.update(rates(nbytes, us, gpu, clone, copy_gbps))
