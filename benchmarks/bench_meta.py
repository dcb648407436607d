"""pytest-benchmark suite of Meta's Llama convention, `apply_rotary_emb(xq, xk, freqs_cis)` (rope.meta), on a CUDA GPU
(without one the tests skip):

    python -m pytest benchmarks/bench_meta.py --benchmark-only -p no:xdist --benchmark-json=bench-out/meta.json
    python benchmarks/report.py bench-out/meta.json --out bench-out

Cases: Llama-3-8B attention (xq 32 heads, xk 8 heads, head dim 128, bf16): prefill of one sequence of 4096 tokens
(freqs_cis [s, d/2]), and one decode step of 64 sequences, with the step's row shared by all of them ([1, d/2], as
Meta's generation loop passes it) or gathered per sequence ([64, 1, d/2]: each at its own position). Per case: clone
of xq and xk, the floor; rope.meta; Meta's PyTorch function (written out below: meta_eager) eager and under
torch.compile; Liger-Kernel's Llama 4 kernel where installed (it rotates xq and xk in their own memory when they are
contiguous, and reads the table's first s rows: no per-token rows). Each forward (under no_grad), backward (the
backward of one recorded forward, replayed) and both. Each must first agree with float64 (complex128 products of
the inputs as given, relative L2 error within checks.REL_TOL): rope failing fails, a peer is skipped with the error.

Timing is bench_rope.py's (its clock, rounds, CUDA-graph replays behind a spin kernel, copy bandwidth fixture);
extra_info carries GB/s, the fraction of copy bandwidth and the ratio to clone of the same case in this run.
"""
from __future__ import annotations

import importlib
import itertools
import math
from typing import NamedTuple

import pytest
import torch


class Case(NamedTuple):
    name: str
    b: int
    s: int
    hq: int
    hk: int
    d: int
    table: str  # "seq": [s, d/2]; "shared": [1, d/2] (decode, one position for all); "token": [b, s, d/2]
    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:
        return f"b {self.b}, s {self.s}, {self.hq}/{self.hk} heads, d {self.d}, bf16, freqs_cis {self.table}"

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads and writes: xq and xk, each once each way (the table is small and shared)."""
        return 2 * self.b * self.s * (self.hq + self.hk) * self.d * torch.finfo(self.dtype).bits // 8


CASES = [Case("llama3-8b-prefill", 1, 4096, 32, 8, 128, "seq"),
         Case("llama3-8b-decode64", 64, 1, 32, 8, 128, "shared"),
         Case("llama3-8b-decode64-positions", 64, 1, 32, 8, 128, "token")]


def freqs_cis_for(case: Case, device, gen) -> torch.Tensor:
    """complex64 rows as Llama's precompute_freqs_cis builds them (theta 500000), at positions past a 4096-token
    prompt for the decode steps (a different one per sequence with `token`)."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, case.d, 2, dtype=torch.float32) / case.d))
    if case.table == "seq":
        pos = torch.arange(case.s, dtype=torch.float32)[:, None]
    elif case.table == "shared":
        pos = torch.full((1, 1), 4096.0)
    else:
        pos = torch.randint(4096, 8192, (case.b, case.s, 1), generator=gen).float()
    angles = pos * inv
    return torch.polar(torch.ones_like(angles), angles).to(device)


def meta_eager(xq, xk, freqs_cis):
    """Meta's function: channels (2i, 2i + 1) as complex numbers times freqs_cis, broadcast over batch and heads
    ([s, d/2] as [1, s, 1, d/2]; per-token [b, s, d/2] as [b, s, 1, d/2]); float32 math, rounded back with type_as."""
    f = freqs_cis.view(1, xq.shape[1], 1, -1) if freqs_cis.dim() == 2 else freqs_cis.unsqueeze(2)
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    return torch.view_as_real(q * f).flatten(3).type_as(xq), torch.view_as_real(k * f).flatten(3).type_as(xk)


def reference64(xq, xk, freqs_cis, gq, gk):
    """float64 outputs and gradients (complex128 products of the inputs as given)."""
    f = freqs_cis.to(torch.complex128)
    f = f.view(1, xq.shape[1], 1, -1) if f.dim() == 2 else f.unsqueeze(2)
    outs, grads = [], []
    for x, g in ((xq, gq), (xk, gk)):
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
        outs.append(torch.view_as_real(z * f).flatten(3))
        gz = torch.view_as_complex(g.double().reshape(*g.shape[:-1], -1, 2).contiguous())
        grads.append(torch.view_as_real(gz * f.conj()).flatten(3))
    return outs, grads


def liger():
    """Liger-Kernel's Llama 4 rotary function, or the reason it is not there."""
    try:
        return importlib.import_module("liger_kernel.transformers.llama4_rope").liger_llama4_text_rotary_pos_emb
    except Exception as e:  # noqa: BLE001 - not installed, or an install that fails to import
        return f"{type(e).__name__}: {e}"[:200]


def impls() -> dict:
    """name -> (callable, whether it is rope, whether it writes xq and xk)."""
    import rope.meta

    out = {"rope": (rope.meta.apply_rotary_emb, True, False), "meta-eager": (meta_eager, False, False),
           "meta-compiled": (torch.compile(meta_eager), False, False)}
    out["liger"] = (liger(), False, True)  # the reason it is missing, where it is
    return out


if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: on a CPU only Triton's interpreter would be timed", allow_module_level=True)

# bench_rope's timing: pytestmark (its clock and round settings) applies to this module's tests too, and copy_gbps is
# its session fixture, found here by name.
from bench_rope import L2_BYTES, MAX_CALLS, MODES, REPLAY_US, copy_gbps, gpu_us, pytestmark, rates  # noqa: E402, F401
from checks import REL_TOL, rel_err  # noqa: E402

IMPL = impls()
PARAMS = [(case, name, mode) for case in CASES for name in ("clone", *IMPL) for mode in
          (MODES if name != "clone" else ("fwd",))]
_STATE = {"case": None}  # the case being benchmarked: input sets, float64 reference, checks, clone's times


def _state(case: Case):
    if _STATE.get("case") != case:
        _STATE.clear()
        torch.cuda.empty_cache()
        gen = torch.Generator().manual_seed(CASES.index(case))
        # input sets enough to span twice the L2 cache, so that a call does not find its input there
        n_sets = max(1, min(64, math.ceil(2 * L2_BYTES / case.nbytes)))
        sets = []
        for _ in range(n_sets):
            xs = [torch.randn(case.b, case.s, h, case.d, generator=gen).to("cuda", case.dtype)
                  for h in (case.hq, case.hk)]
            gs = [torch.randn(x.shape, generator=gen).to("cuda", case.dtype) for x in xs]
            sets.append((xs, gs))
        freqs = freqs_cis_for(case, "cuda", gen)
        ref = reference64(*sets[0][0], freqs, *sets[0][1])
        _STATE.update(case=case, sets=sets, freqs=freqs, ref=ref, checks={}, clone={})
    return _STATE


def _check(fn, writes, state):
    """(worst forward, worst backward relative error) of fn on set 0, on copies (a peer may write its inputs)."""
    (xq, xk), (gq, gk) = state["sets"][0]
    leaves = [x.detach().clone().requires_grad_() for x in (xq, xk)]
    outs = fn(*[x.clone() for x in leaves] if writes else leaves, state["freqs"])
    grads = torch.autograd.grad(outs, leaves, [gq.clone(), gk.clone()])
    ref_outs, ref_grads = state["ref"]
    fwd = max(rel_err(o, r) for o, r in zip(outs, ref_outs, strict=True))
    bwd = max(rel_err(g, r) for g, r in zip(grads, ref_grads, strict=True))
    return fwd, bwd


def _calls(fn, writes, state, mode) -> list:
    """One zero-argument call per input set (clone where fn is None). A peer that writes its inputs rotates the same
    tensors (copies of the set, or non-leaf products of leaves) again at every call: the bytes moved are the same."""
    calls = []
    for (xq, xk), (gq, gk) in state["sets"]:
        if fn is None:
            calls.append(lambda xq=xq, xk=xk: (xq.clone(), xk.clone()))
        elif mode == "fwd":
            if writes:  # copies made once, rotated again by every call: the sets stay as the checks read them
                xq, xk = xq.clone(), xk.clone()
            calls.append(torch.no_grad()(lambda xq=xq, xk=xk: fn(xq, xk, state["freqs"])))
        else:
            leaves = [x.detach().clone().requires_grad_() for x in (xq, xk)]
            ins = [x * 1 for x in leaves] if writes else leaves  # a peer writing in place needs non-leaf inputs
            if mode == "bwd":
                outs = fn(*ins, state["freqs"])
                calls.append(lambda outs=outs, leaves=leaves, gs=(gq, gk): torch.autograd.grad(
                    outs, leaves, list(gs), retain_graph=True))
            else:
                calls.append(lambda leaves=leaves, gs=(gq, gk): torch.autograd.grad(
                    fn(*([x * 1 for x in leaves] if writes else leaves), state["freqs"]), leaves, list(gs)))
    return calls


@pytest.mark.parametrize(("case", "impl_name", "mode"), PARAMS, ids=[f"{c.name}-{i}-{m}" for c, i, m in PARAMS])
def test_meta(benchmark, copy_gbps, case, impl_name, mode):  # noqa: F811 (copy_gbps: the fixture imported above)
    fn, ours, writes = IMPL.get(impl_name, (None, False, False))
    if impl_name != "clone" and not callable(fn):
        pytest.skip(f"{impl_name}: not timed, {fn}")
    state = _state(case)
    benchmark.group = f"{case.name}: {case.label}"
    info = benchmark.extra_info
    info.update(suite="meta", case=case.name, label=case.label, impl=impl_name, mode=mode)
    if fn is not None:
        if impl_name not in state["checks"]:
            try:
                state["checks"][impl_name] = _check(fn, writes, state)
            except Exception as e:  # noqa: BLE001 - a peer that refuses the case is reported, not timed
                if ours:
                    raise
                pytest.skip(f"{impl_name}: not timed, {type(e).__name__}: {e}"[:300])
        fwd, bwd = state["checks"][impl_name]
        # checks.REL_TOL for bf16: 1e-2 of ||ref||, about 1.3 bf16 ulps; one rounding gives a fifth of it, a sign or
        # row error order 1 (the per-token case: Liger reads the first rows, far past the bound).
        if not (fwd <= REL_TOL[case.dtype] and bwd <= REL_TOL[case.dtype]):
            message = f"relative L2 error forward {fwd:.3g}, backward {bwd:.3g} (bound {REL_TOL[case.dtype]})"
            if ours:
                pytest.fail(f"{impl_name} disagrees with float64 on {case.name}: {message}")
            pytest.skip(f"{impl_name} disagrees with float64 on {case.name}, not timed: {message}")
        info.update(fwd_rel_err=fwd, bwd_rel_err=bwd)
    if writes:
        info["note"] = "rotates xq and xk in their own memory"

    calls = _calls(fn, writes, state, mode)
    for call in calls:  # warm-up outside the timing: torch.compile's compilation, Triton's autotuning
        call()
    torch.cuda.synchronize()
    cycle = itertools.cycle(calls)
    benchmark(lambda: next(cycle)())
    if benchmark.stats is None:  # --benchmark-disable: the target ran once, nothing was timed
        return
    nbytes = case.nbytes * (2 if mode == "fwd+bwd" else 1)
    us = benchmark.stats.stats.median * 1e6
    gpu = None
    n_calls = min(MAX_CALLS, math.ceil(REPLAY_US * copy_gbps * 1e3 / nbytes))
    try:
        gpu = gpu_us(lambda: _calls(fn, writes, state, mode), n_calls)
    except Exception as e:  # rope must capture; a peer that cannot is timed eagerly only
        if ours or fn is None:
            raise
        info["capture_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.synchronize()
    if fn is None:
        state["clone"] = {"us": us, "gpu_us": gpu}
    info.update(rates(nbytes, us, gpu, state["clone"], copy_gbps))
