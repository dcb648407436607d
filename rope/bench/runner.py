"""One benchmark run: copy bandwidth, then per case the float64 check and timings of every impl.

All implementations of a case see the same input sets, the same angles and the same copy
bandwidth, measured once at the start of the same run, so their ratios are taken under the same
conditions. A case runs the implementations meant for its kind (one tensor, q and k, in place);
a forward-only implementation (in place) gets no backward timing.
"""
from __future__ import annotations

import time
import traceback

import torch

from .checks import check_impl, reference64
from .inputs import leaf, make_inputs, parts, sets_for
from .machine import machine_info
from .progress import Progress
from .shapes import Case
from .timing import Budget, Timing, copy_bandwidth, gpu_time, host_ratio, host_time, l2_bytes


def case_dict(case: Case) -> dict:
    return {
        "case": case.name, "label": case.label, "format": case.fmt, "dtype": case.dtype,
        "shape": list(case.shape), "rot_dim": case.d2, "head_dim": case.d, "interleaved": case.interleaved,
        "seq_len": case.seq_len, "tokens": case.tokens, "n_seqs": len(case.seqlens) or None,
        "start_positions": bool(case.start_max), "bytes_fwd": case.bytes_fwd, "bytes_bwd": case.bytes_bwd,
        "small": case.small, "large": case.large, "sweep": "sweep" in case.tags, "note": case.note,
        "kind": case.kind, "k_heads": case.hk or None, "qk_headline": "qk_headline" in case.tags,
    }


def timing_dict(t: Timing, nbytes: int, copy_gbps: float) -> dict:
    d = t.as_dict()
    gbps = nbytes / (t.us * 1e-6) / 1e9 if t.us > 0 else float("nan")
    d.update(gbps=gbps, frac_copy=gbps / copy_gbps if copy_gbps else float("nan"))
    return d


def _forward_calls(impl, inputs):
    def build():
        fns = []
        for t in inputs.ts:
            b = impl.bind(inputs, t)
            fns.append(lambda b=b: b.fn(*b.xs))
        return fns

    return build


def _backward_calls(impl, inputs):
    def build():
        fns = []
        for t, g in zip(inputs.ts, inputs.gs, strict=True):
            b = impl.bind(inputs, leaf(t), g)
            outs = b.fn(*b.xs)  # recorded once; each timed call replays only the backward
            fns.append(lambda b=b, outs=outs: torch.autograd.grad(outs, b.xs, b.gs, retain_graph=True))
        return fns

    return build


def host_costs(impl, inputs, device, budget: Budget, clone) -> dict:
    """Host µs per eager call (forward under no_grad, forward recording autograd, backward), each
    also as a ratio to `clone` (the same tensor's clone under no_grad) in alternating rounds."""
    t, g = inputs.ts[0], inputs.gs[0]
    b0 = impl.bind(inputs, t)
    fwd, _, fwd_x = host_ratio(lambda: b0.fn(*b0.xs), clone, device, budget, no_grad=True)
    out = {"fwd_us": fwd.us, "fwd_grad_us": None, "bwd_us": None, "calls": fwd.calls, "fwd_x_clone": fwd_x,
           "fwd_grad_x_clone": None, "bwd_x_clone": None}
    if not impl.backward:
        return out
    b1 = impl.bind(inputs, leaf(t), g)
    fwd_grad, _, fwd_grad_x = host_ratio(lambda: b1.fn(*b1.xs), clone, device, budget)
    outs = b1.fn(*b1.xs)
    bwd, _, bwd_x = host_ratio(lambda: torch.autograd.grad(outs, b1.xs, b1.gs, retain_graph=True), clone, device,
                               budget)
    out.update(fwd_grad_us=fwd_grad.us, bwd_us=bwd.us, fwd_grad_x_clone=fwd_grad_x, bwd_x_clone=bwd_x)
    return out


def _one_line(exc) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def clone_call(inputs):
    """torch.clone of the case's first input set (q and k: both): the host cost's yardstick."""
    t = inputs.ts[0]
    return (lambda t=t: [x.clone() for x in parts(t)]) if inputs.case.hk else (lambda t=t: t.clone())


def run_impl(impl, inputs, ref, device, budget: Budget, copy_gbps: float, log) -> dict:
    case = inputs.case
    row = {"impl": impl.name, "title": impl.title, "layout": impl.layout, "status": "ok", "reason": "",
           "impl_note": impl.note_for(case)}
    why = impl.missing() or impl.unsupported(case)
    if why:
        row.update(status="skipped", reason=why)
        return row
    t0 = time.perf_counter()
    try:
        chk = check_impl(impl, inputs, inputs.ts[0], inputs.gs[0], ref)
        row["check"] = chk.as_dict()
        if not chk.ok:
            row.update(status="check_failed", reason=chk.message)
            return row
        safe = impl.bind(inputs, inputs.ts[0]).graph_safe
        with impl.timing_context():
            fwd = gpu_time(_forward_calls(impl, inputs), device, budget, no_grad=True, graph=safe)
            row["fwd"] = timing_dict(fwd, case.bytes_fwd, copy_gbps)
            if impl.backward:
                bwd = gpu_time(_backward_calls(impl, inputs), device, budget, graph=safe)
                row["bwd"] = timing_dict(bwd, case.bytes_bwd, copy_gbps)
        if case.small:
            row["host"] = host_costs(impl, inputs, device, budget, clone_call(inputs))
    except Exception as exc:  # one broken implementation must not end the run
        row.update(status="error", reason=_one_line(exc))
        log(f"{case.name} / {impl.name}: " + "".join(traceback.format_exception(exc)).rstrip())
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    finally:
        row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def run(cases, impls, device, budget: Budget | None = None, seed: int = 0, show_progress=True) -> dict:
    device = torch.device(device)
    budget = budget or Budget()
    meta = machine_info(device)
    per_case = [[impl for impl in impls if case.kind in impl.kinds] for case in cases]
    progress = Progress(1 + sum(1 + len(p) for p in per_case if p), enabled=show_progress)
    progress.step("copy bandwidth")
    copy_gbps, copy_t = copy_bandwidth(device, budget)
    progress.done()
    meta.update(copy_gbps=copy_gbps, copy_bytes=budget.copy_bytes, copy_timing=copy_t.as_dict())
    l2 = l2_bytes(device)
    rows = []
    t_start = time.perf_counter()
    for i, (case, case_impls) in enumerate(zip(cases, per_case, strict=True)):
        if not case_impls:  # none of the selected implementations runs this kind of case
            continue
        progress.step(f"{case.name}: inputs and float64 reference")
        inputs = make_inputs(case, device, sets_for(case, device, l2), seed=seed + i)
        ref = reference64(inputs, inputs.ts[0], inputs.gs[0])
        if case.hk:  # the floor for q and k: clone both (two launches)
            clone = gpu_time(lambda ts=inputs.ts: [lambda t=t: [x.clone() for x in parts(t)] for t in ts], device,
                             budget, no_grad=True)
        else:
            clone = gpu_time(lambda ts=inputs.ts: [lambda t=t: t.clone() for t in ts], device, budget, no_grad=True)
        base = case_dict(case)
        base["n_sets"] = len(inputs.ts)
        base["clone"] = timing_dict(clone, 2 * case.numel * case.elem_bytes, copy_gbps)
        if case.small:
            t = inputs.ts[0]
            base["clone"]["host_us"] = host_time(clone_call(inputs), device, budget, no_grad=True).us
            if not case.hk:
                # The floor under any backward's host cost: torch.autograd.grad through a clone,
                # whose backward is the identity (engine entry, device thread hand-off, return).
                x, g = leaf(t), inputs.gs[0]
                y = x.clone()
                floor, _, floor_x = host_ratio(lambda x=x, y=y, g=g: torch.autograd.grad(y, x, g, retain_graph=True),
                                               clone_call(inputs), device, budget)
                base["clone"]["bwd_host_us"], base["clone"]["bwd_host_x_clone"] = floor.us, floor_x
        progress.done()
        for impl in case_impls:
            progress.step(f"{case.name}: {impl.name}")
            row = dict(base)
            row.update(run_impl(impl, inputs, ref, device, budget, copy_gbps, progress.write))
            rows.append(row)
            progress.done()
        del inputs, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    meta["wall_s"] = round(time.perf_counter() - t_start, 1)
    return {"meta": meta, "results": rows}
