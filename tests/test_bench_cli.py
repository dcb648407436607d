"""The benchmark harness on the CPU: the CLI end to end in smoke mode, the peer adapters against
stand-ins that follow each library's documented semantics, and the targets' bookkeeping.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from rope.bench import peers, report
from rope.bench.checks import check_impl, reference64
from rope.bench.inputs import make_inputs
from rope.bench.shapes import CASES, SMOKE_CASES, Case, select

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run_cli(args, env_drop=(), timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run([sys.executable, "-m", "rope.bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(DEVICE == "cuda", reason="smoke mode is the CPU check; on a GPU run `python -m rope.bench` itself")
def test_smoke_run_end_to_end(tmp_path):
    # Without TRITON_INTERPRET in the environment: on a CPU-only machine the CLI must restart
    # itself with the interpreter, as it does for a user.
    args = ["--smoke", "--out", str(tmp_path), "--no-progress"]
    if DEVICE == "cuda":  # inductor would compile for a minute; the CPU run covers torch.compile's plumbing
        args += ["--impls", "ours,reference,te,flash,liger"]
    proc = _run_cli(args, env_drop=("TRITON_INTERPRET",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    meta = results["meta"]
    assert meta["mode"] == "smoke" and meta["copy_gbps"] > 0
    assert meta["command"].startswith("python -m rope.bench --smoke")
    rows = {(r["case"], r["impl"]): r for r in results["results"]}
    assert {c for c, _ in rows} == {c.name for c in SMOKE_CASES}
    kinds = {c.kind for c in SMOKE_CASES}
    assert kinds == {"t", "qk", "inplace"}
    for case in SMOKE_CASES:
        # each kind of case gets the implementations meant for it, and no others
        want = {"t": {"ours", "ours_graph", "ours_compiled", "reference", "compile", "te", "flash", "liger"},
                "qk": {"ours_qk", "ours_2x", "ours_compiled", "reference", "compile"},
                "inplace": {"ours_inplace"}}[case.kind]
        got = {i for c, i in rows if c == case.name}
        assert got == want, (case.name, got)
        for impl in ("ours", "ours_graph", "ours_qk", "ours_2x", "ours_compiled", "reference", "compile"):
            if (case.name, impl) not in rows:
                continue
            r = rows[(case.name, impl)]
            if impl == "compile" and case.fmt == "thd":
                assert r["status"] == "skipped" and r["reason"]
                continue
            assert r["status"] == "ok", (case.name, impl, r["reason"])
            assert r["check"]["ok"] and r["check"]["fwd_rel_err"] <= r["check"]["tol"]
            for d in ("fwd", "bwd"):
                assert r[d]["us"] > 0 and r[d]["gbps"] > 0 and r[d]["frac_copy"] > 0
            assert ("host" in r) == case.small
            if case.hk:  # both tensors checked, forward and backward; bytes of both
                assert len(r["check"]["fwd_rel_errs"]) == len(r["check"]["bwd_rel_errs"]) == 2
                assert r["bytes_fwd"] == case.bytes_fwd and r["k_heads"] == case.hk
                two_calls = impl in ("reference", "compile", "ours_compiled")
                assert two_calls == (r["impl_note"] == "two calls, q then k")
        if case.inplace:
            r = rows[(case.name, "ours_inplace")]
            assert r["status"] == "ok", r["reason"]
            assert r["check"]["ok"] and r["check"]["bwd_rel_err"] is None
            assert r["fwd"]["us"] > 0 and "bwd" not in r and "repeated rotations of one buffer" in r["impl_note"]
        for impl, module in (("te", "transformer_engine"), ("flash", "flash_attn"), ("liger", "liger_kernel")):
            if case.kind == "t" and importlib.util.find_spec(module) is None:
                r = rows[(case.name, impl)]
                assert r["status"] == "skipped" and "not installed" in r["reason"]
    # small cases are compared with clone, in a graph and on the host
    assert any(t["target"].startswith("small host fwd") for t in results["targets"])
    targets = {(t["case"], t["target"]) for t in results["targets"]}
    for d in ("fwd", "bwd"):
        assert ("smoke_qk", f"qk {d} faster than two single calls") in targets
        assert ("smoke_qk", f"qk {d} >= 95% of copy counting both tensors") in targets
    assert "clone host µs" in proc.stdout and "| smoke_decode" in proc.stdout
    assert "| smoke_qk" in proc.stdout and "| smoke_inplace" in proc.stdout
    assert "qk fwd faster than two single calls" in proc.stdout
    assert (tmp_path / "table.md").read_text().count("| smoke_") == len(rows)
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("sweep_fwd.png", "sweep_bwd.png"):
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in proc.stderr


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU-only refusal")
def test_cpu_refuses_to_time_the_interpreter(tmp_path):
    proc = _run_cli(["--shapes", "small_64", "--out", str(tmp_path)])
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--smoke" in proc.stderr
    assert not (tmp_path / "results.json").exists()


def test_bad_names_are_reported():
    with pytest.raises(ValueError, match="unknown case"):
        select(["nope"])
    with pytest.raises(ValueError, match="unknown implementation"):
        peers.make_impls(["nope"])


def test_case_list_and_bytes():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    quick = select(quick=True)
    assert 0 < len(quick) < len(CASES)
    head = next(c for c in CASES if c.name == "headline_bf16")
    assert head.shape == (2048, 16, 8, 256)
    assert head.bytes_fwd == 2 * 2048 * 16 * 8 * 256 * 2 + 2048 * 256 * 4
    partial = next(c for c in CASES if c.name == "partial")
    assert partial.d2 == 64 and partial.bytes_fwd == 2 * partial.numel * 2 + 4096 * 64 * 4  # tail counted
    thd = next(c for c in CASES if c.name == "thd_short")
    twin = next(c for c in CASES if c.name == "bshd_2048x8")
    assert thd.tokens == twin.tokens and thd.numel == twin.numel
    assert thd.bytes_fwd == 2 * thd.numel * 2 + 8 * 128 * 4  # angles: the longest sequence's rows
    decode = next(c for c in CASES if c.name == "decode")
    assert decode.shape == (1, 64, 32, 128) and decode.small
    assert all(c.large for c in CASES if c.name.startswith(("headline", "llama", "thd", "partial")))
    # q and k: both tensors read and written, the angle rows once; k has its own head count
    gqa = next(c for c in CASES if c.name == "qk_llama_gqa")
    assert gqa.kind == "qk" and gqa.shapes == [(4096, 2, 32, 128), (4096, 2, 8, 128)]
    assert gqa.bytes_fwd == 2 * 4096 * 2 * (32 + 8) * 128 * 2 + 4096 * 128 * 4 and gqa.large
    mqa = next(c for c in CASES if c.name == "qk_mqa_decode")
    assert mqa.shapes == [(1, 64, 32, 128), (1, 64, 1, 128)] and mqa.small and mqa.start_max
    qthd = next(c for c in CASES if c.name == "qk_thd_short")
    assert qthd.shapes == [(16384, 32, 128), (16384, 8, 128)] and qthd.seqlens == (8,) * 2048
    inplace = next(c for c in CASES if c.name == "llama_inplace")
    llama = next(c for c in CASES if c.name == "llama_sbhd")
    assert inplace.kind == "inplace" and inplace.shape == llama.shape and inplace.bytes_fwd == llama.bytes_fwd
    assert {"qk_llama_gqa", "llama_inplace"} <= {c.name for c in quick}
    assert [c.name for c in CASES if "qk_headline" in c.tags] == ["qk_llama_gqa"]
    # the single-tensor cases keep their places (a case's inputs are seeded by its index in a run)
    assert [c.kind for c in CASES] == sorted((c.kind for c in CASES), key=lambda k: k != "t")
    assert [c.kind for c in quick] == sorted((c.kind for c in quick), key=lambda k: k != "t")


# ---- stand-ins for the optional peers, written from their documented semantics -----------------

def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


def _rotate_pairs(x, cos, sin, interleaved, sign):
    """x [..., r] (float32) rotated by the half-angle tables cos/sin [..., r/2] (flash-attn's convention)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin), dim=-1)


class _FlashRotary(torch.autograd.Function):
    """flash_attn.layers.rotary.apply_rotary_emb: x (b, s, h, d) or (total, h, d) with cu_seqlens;
    cos/sin (seqlen_ro, rotary_dim/2) in x's dtype; seqlen_offsets int or (b,); output like
    torch.empty_like(x); backward = the same with sin negated (the conjugate)."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen):
        ctx.args = (cos, sin, interleaved, seqlen_offsets, cu_seqlens)
        return _flash_apply(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, 1.0)

    @staticmethod
    def backward(ctx, g):
        cos, sin, interleaved, seqlen_offsets, cu_seqlens = ctx.args
        return _flash_apply(g, cos, sin, interleaved, seqlen_offsets, cu_seqlens, -1.0), *([None] * 6)


def _flash_apply(x, cos, sin, interleaved, offsets, cu, sign):
    assert x.dtype == cos.dtype == sin.dtype, "Input and cos/sin must have the same dtype"
    r = 2 * cos.shape[1]
    assert r <= x.shape[-1]
    if cu is None:
        b, s = x.shape[:2]
        pos = torch.arange(s, device=x.device)[None, :].expand(b, s)
        if isinstance(offsets, torch.Tensor):
            assert offsets.shape == (b,)
        pos = pos + (offsets.long()[:, None] if isinstance(offsets, torch.Tensor) else offsets)
    else:
        lens = (cu[1:] - cu[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens)
        pos = torch.arange(x.shape[0], device=x.device) - cu.long()[seq]
    c, s_ = cos.float()[pos].unsqueeze(-2), sin.float()[pos].unsqueeze(-2)  # broadcast over heads
    out = torch.empty_like(x)
    out[..., :r] = _rotate_pairs(x[..., :r].float(), c, s_, interleaved, sign).to(x.dtype)
    out[..., r:] = x[..., r:]
    return out


def flash_apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                           max_seqlen=None):
    assert not inplace
    if cu_seqlens is not None:
        assert max_seqlen is not None, "If cu_seqlens is passed in, then max_seqlen must be passed"
    return _FlashRotary.apply(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen)


class _LigerRope(torch.autograd.Function):
    """liger_kernel: q (b, hq, s, d), k (b, hk, s, d), cos/sin (1 or b, s, d) with duplicated halves;
    works on q.transpose(1, 2).contiguous() in place, arithmetic in cos's dtype; returns views."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _liger_inplace(q, cos, sin, 1.0), _liger_inplace(k, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return _liger_inplace(dq, cos, sin, -1.0), _liger_inplace(dk, cos, sin, -1.0), None, None


def _liger_inplace(v, cos, sin, sign):
    phys = v.transpose(1, 2).contiguous()  # [b, s, h, d]; no copy for projection outputs
    half = phys.shape[-1] // 2
    c, s_ = cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)
    x = phys.to(cos.dtype)
    with torch.no_grad():
        phys.copy_(_rotate_pairs(x, c, s_, False, sign))
    return phys.transpose(1, 2)


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return _LigerRope.apply(q, k, cos, sin)


def _te_apply(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=False,
              cu_seqlens=None, cp_size=1, cp_rank=0):
    from rope import reference

    return reference.apply_rotary_pos_emb(t, freqs, tensor_format, start_positions, interleaved, False, cu_seqlens,
                                          cp_size, cp_rank)


@pytest.fixture
def fake_peers(monkeypatch):
    mods = {
        "flash_attn": _module("flash_attn"),
        "flash_attn.layers": _module("flash_attn.layers"),
        "flash_attn.layers.rotary": _module("flash_attn.layers.rotary", apply_rotary_emb=flash_apply_rotary_emb),
        "liger_kernel": _module("liger_kernel"),
        "liger_kernel.transformers": _module("liger_kernel.transformers"),
        "liger_kernel.transformers.rope": _module("liger_kernel.transformers.rope",
                                                  liger_rotary_pos_emb=liger_rotary_pos_emb),
        "transformer_engine": _module("transformer_engine"),
        "transformer_engine.pytorch": _module("transformer_engine.pytorch"),
        "transformer_engine.pytorch.attention": _module("transformer_engine.pytorch.attention"),
        "transformer_engine.pytorch.attention.rope": _module("transformer_engine.pytorch.attention.rope",
                                                             apply_rotary_pos_emb=_te_apply),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods


ADAPTER_CASES = [
    Case("a_sbhd", "sbhd", 6, 2, 4, 16, "fp32"),
    Case("a_bshd_bf16", "bshd", 5, 2, 2, 16, "bf16"),
    Case("a_sbhd_partial", "sbhd", 4, 2, 2, 16, "fp16", rot_dim=8),
    Case("a_interleaved", "bshd", 4, 3, 2, 16, "fp32", interleaved=True),
    Case("a_thd", "thd", 0, 1, 2, 16, "fp32", seqlens=(3, 0, 5, 2)),
    Case("a_decode", "sbhd", 1, 3, 4, 16, "fp32", start_max=20),
]
UNSUPPORTED = {
    ("liger", "a_sbhd_partial"), ("liger", "a_interleaved"), ("liger", "a_thd"),
}


@pytest.mark.parametrize("case", ADAPTER_CASES, ids=lambda c: c.name)
def test_peer_adapters_agree_with_float64(fake_peers, case):
    """Each adapter's layout conversion (views, q/k split, cos/sin tables, offsets) is right."""
    inputs = make_inputs(case, DEVICE, n_sets=1, seed=3)
    t, g = inputs.ts[0], inputs.gs[0]
    ref = reference64(inputs, t, g)
    for impl in peers.make_impls(["te", "flash", "liger"]):
        assert impl.missing() is None
        why = impl.unsupported(case)
        if (impl.name, case.name) in UNSUPPORTED:
            assert why
            continue
        assert why is None, (impl.name, why)
        t_before = t.clone()
        result = check_impl(impl, inputs, t, g, ref)
        assert result.ok, (impl.name, case.name, result.message)
        assert torch.equal(t, t_before), f"{impl.name}: the shared input set was modified"


def test_check_catches_a_wrong_peer(fake_peers, monkeypatch):
    """The float64 check is not vacuous: a peer with the sine's sign flipped fails it."""
    case = ADAPTER_CASES[0]
    inputs = make_inputs(case, DEVICE, n_sets=1, seed=4)
    ref = reference64(inputs, inputs.ts[0], inputs.gs[0])

    def wrong(x, cos, sin, **kw):
        return flash_apply_rotary_emb(x, cos, -sin, **kw)

    monkeypatch.setattr(sys.modules["flash_attn.layers.rotary"], "apply_rotary_emb", wrong)
    result = check_impl(peers.make_impls(["flash"])[0], inputs, inputs.ts[0], inputs.gs[0], ref)
    assert not result.ok and result.fwd_err > 0.1


def test_missing_peer_is_a_skip_with_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as if not installed
    impl = peers.make_impls(["flash"])[0]
    assert impl.missing()


def _row(case, impl, fwd_us, bwd_us, frac, small=False, large=False, host=None, clone_us=2.0, clone_host=10.0,
         qk_headline=False):
    def t(us):
        return {"us": us, "method": "graph", "frac_copy": frac, "gbps": 1.0}

    r = {"case": case, "impl": impl, "status": "ok", "small": small, "large": large, "fwd": t(fwd_us),
         "bwd": t(bwd_us), "clone": {"us": clone_us, "method": "graph", "host_us": clone_host},
         "qk_headline": qk_headline}
    if host:
        r["host"] = dict(zip(("fwd_us", "fwd_grad_us", "bwd_us"), host, strict=True))
    return r


def test_host_target_prefers_the_ratio_taken_beside_clone():
    """Where the run measured the host cost in rounds alternating with clone's, the target uses that
    ratio, not the quotient of two costs measured apart (host load drifts between them)."""
    row = _row("tiny", "ours", 1.0, 1.0, 0.1, small=True, host=(9.0, 14.0, 14.0))  # 0.9x, 1.4x apart
    row["host"].update(fwd_x_clone=1.2, fwd_grad_x_clone=1.3, bwd_x_clone=None)
    got = {t["target"]: (t["value"], t["ok"]) for t in report.evaluate_targets({"results": [row]})}
    assert got["small host fwd <= 1.0x clone"] == (1.2, False)
    assert got["small host fwd_grad <= 1.5x clone"] == (1.3, True)
    assert got["small host bwd <= 1.5x clone"] == (1.4, True)  # no ratio: the quotient


def test_host_ratio_measures_both_callables():
    """host_ratio times both callables and gives fn's time over ref's (medians over pairs of
    rounds): a callable that spins twice as long as the reference measures about 2."""
    from rope.bench.timing import Budget, host_ratio

    def spin(us):
        def fn():
            end = time.perf_counter() + us * 1e-6
            while time.perf_counter() < end:
                pass
        return fn

    budget = Budget(warmup=1, host_calls=20, host_rounds=7, host_round_ms=10.0)
    mine, ref, ratio = host_ratio(spin(400), spin(200), "cpu", budget)
    assert 1.7 < ratio < 2.3, ratio
    assert mine.reps == ref.reps == 7 and 350 < mine.us < 600 and 170 < ref.us < 300


def test_targets_bookkeeping():
    results = {"results": [
        _row("big", "ours", 100, 100, 0.96, large=True),
        _row("big2", "ours", 100, 100, 0.90, large=True, clone_us=95.0),
        _row("tiny", "ours", 2.2, 2.5, 0.1, small=True, host=(9.0, 16.0, 14.0)),
        _row("thd_short", "ours", 104, 110, 0.9),
        _row("bshd_2048x8", "ours", 100, 100, 0.9),
        _row("big2", "reference", 1000, 1000, 0.09, large=True),
    ]}
    got = {(t["case"], t["target"]): t["ok"] for t in report.evaluate_targets(results)}
    assert got[("big", "large fwd >= 95% of copy")] and not got[("big2", "large bwd >= 95% of copy")]
    assert got[("tiny", "small fwd in a graph <= clone + 0.3 µs")]
    assert not got[("tiny", "small bwd in a graph <= clone + 0.3 µs")]
    assert got[("tiny", "small host fwd <= 1.0x clone")]
    assert not got[("tiny", "small host fwd_grad <= 1.5x clone")]
    assert got[("tiny", "small host bwd <= 1.5x clone")]
    assert got[("thd_short vs bshd_2048x8", "thd fwd <= 1.05x bshd, same tokens")]
    assert not got[("thd_short vs bshd_2048x8", "thd bwd <= 1.05x bshd, same tokens")]
    assert not any(case == "big2" and "reference" in target for case, target in got)
    assert "MISS" in report.targets_text(report.evaluate_targets(results))
    # a copy target says what clone of the same bytes reached: 0.90 of copy in 100 µs, clone 95 µs
    detail = {(t["case"], t["target"]): t["detail"] for t in report.evaluate_targets(results)}
    assert detail[("big2", "large fwd >= 95% of copy")] == "clone 94.7% of copy; 95.0% of clone's speed"


def test_qk_targets_bookkeeping():
    results = {"results": [
        _row("qk_big", "ours_qk", 40, 50, 0.96, large=True, qk_headline=True),
        _row("qk_big", "ours_2x", 45, 50, 0.85, large=True, qk_headline=True),
        _row("qk_big", "reference", 900, 9000, 0.01, large=True, qk_headline=True),
        _row("qk_small", "ours_qk", 3.0, 2.0, 0.1, small=True),
        _row("qk_small", "ours_2x", 5.0, 4.0, 0.1, small=True),
        _row("qk_other", "ours_qk", 10, 10, 0.5),
        dict(_row("qk_other", "ours_2x", 1, 1, 0.5), status="error"),
    ]}
    targets = report.evaluate_targets(results)
    got = {(t["case"], t["target"]): t for t in targets}
    copy_fwd = got[("qk_big", "qk fwd >= 95% of copy counting both tensors")]
    assert copy_fwd["ok"] and copy_fwd["value"] == 0.96
    assert got[("qk_big", "qk bwd >= 95% of copy counting both tensors")]["ok"]
    assert got[("qk_big", "qk fwd faster than two single calls")]["ok"]
    assert not got[("qk_big", "qk bwd faster than two single calls")]["ok"]  # equal time is not faster
    assert got[("qk_small", "qk fwd faster than two single calls")]["value"] == pytest.approx(0.6)
    # the copy target is for the headline qk case only; nothing is compared with a failed ours_2x
    assert not any(case != "qk_big" and "copy" in target for case, target in got)
    assert not any(case == "qk_other" for case, _ in got)
    # single-tensor targets never look at the qk implementations
    assert not any(t["target"].startswith(("large", "small")) for t in targets)
    text = report.targets_text(targets)
    assert "PASS  qk fwd >= 95% of copy counting both tensors" in text and "96.0%" in text


QK_CASES = [
    Case("q_sbhd_gqa", "sbhd", 5, 2, 4, 16, "fp32", hk=2),
    Case("q_bshd_mqa_bf16", "bshd", 3, 2, 4, 16, "bf16", hk=1, interleaved=True),
    Case("q_thd", "thd", 0, 1, 4, 16, "fp16", hk=2, seqlens=(3, 0, 5, 2), rot_dim=8),
    Case("q_decode", "sbhd", 1, 3, 2, 16, "fp32", hk=1, start_max=20),
]


@pytest.mark.parametrize("case", QK_CASES, ids=lambda c: c.name)
def test_qk_adapters_agree_with_float64(case):
    """The q/k adapters: both outputs and both input gradients checked, inputs left as they were."""
    inputs = make_inputs(case, DEVICE, n_sets=2, seed=5)
    t, g = inputs.ts[0], inputs.gs[0]
    assert [tuple(x.shape) for x in t] == case.shapes == [tuple(x.shape) for x in g]
    ref = reference64(inputs, t, g)
    before = [x.clone() for x in t]
    # aot_eager: dynamo and AOTAutograd without a C++ toolchain on CPU, as the smoke run does
    impls = peers.make_impls(["ours_qk", "ours_2x", "ours_compiled", "reference", "compile"],
                             compile_backend="aot_eager")
    for impl in impls:
        if impl.unsupported(case):
            assert impl.name == "compile" and case.fmt == "thd"
            continue
        result = check_impl(impl, inputs, t, g, ref)
        assert result.ok, (impl.name, case.name, result.message)
        assert len(result.fwd_errs) == len(result.bwd_errs) == 2 and result.bwd_err is not None
    assert all(torch.equal(a, b) for a, b in zip(t, before, strict=True))
    for impl in peers.make_impls(["ours", "ours_inplace", "te", "flash", "liger"]):
        assert "qk" not in impl.kinds


def test_qk_check_looks_at_k():
    """A wrong k alone (or a wrong k gradient alone) fails the check."""
    case = QK_CASES[0]
    inputs = make_inputs(case, DEVICE, n_sets=1, seed=6)
    t, g = inputs.ts[0], inputs.gs[0]
    ref = reference64(inputs, t, g)
    impl = peers.make_impls(["ours_2x"])[0]

    class WrongK(type(impl)):
        def bind(self, inputs, t, g=None):
            b = super().bind(inputs, t, g)
            fn = b.fn
            b.fn = lambda q, k: [fn(q, k)[0], fn(q, k.flip(0))[1]]
            return b

    result = check_impl(WrongK(), inputs, t, g, ref)
    assert not result.ok and result.fwd_errs[0] < 1e-5 < result.fwd_errs[1]
    assert "k forward" in result.message

    class WrongKGrad(type(impl)):
        def bind(self, inputs, t, g=None):
            b = super().bind(inputs, t, g)
            b.gs = [b.gs[0], -b.gs[1]]
            return b

    result = check_impl(WrongKGrad(), inputs, t, g, ref)
    assert not result.ok and result.fwd_err < 1e-5 and result.bwd_errs[0] < 1e-5 < result.bwd_errs[1]


@pytest.mark.parametrize("case", [Case("i_sbhd", "sbhd", 5, 2, 4, 16, "bf16", inplace=True),
                                  Case("i_thd", "thd", 0, 1, 2, 16, "fp32", inplace=True, seqlens=(3, 5))],
                         ids=lambda c: c.name)
def test_inplace_adapter(case):
    """In place: checked forward only, rotates its own working copy, never the shared input set."""
    inputs = make_inputs(case, DEVICE, n_sets=1, seed=7)
    t, g = inputs.ts[0], inputs.gs[0]
    ref = reference64(inputs, t, g)
    before = t.clone()
    impl = peers.make_impls(["ours_inplace"])[0]
    assert impl.kinds == {"inplace"} and not impl.backward and impl.inplace
    result = check_impl(impl, inputs, t, g, ref)
    assert result.ok and result.bwd_err is None, result.message
    b = impl.bind(inputs, t)
    ptr = b.xs[0].data_ptr()
    with torch.no_grad():
        first = b.fn(*b.xs)[0].clone()
        second = b.fn(*b.xs)[0]  # the same buffer rotated again: the timed calls do this
    assert second.data_ptr() == ptr and not torch.equal(first, second)
    assert torch.equal(t, before)
    assert "repeated rotations of one buffer" in impl.note_for(case)


def test_inplace_check_requires_the_inputs_memory(monkeypatch):
    """An 'in place' implementation that returns a new tensor fails the check."""
    case = Case("i_fake", "sbhd", 3, 2, 2, 16, "fp32", inplace=True)
    inputs = make_inputs(case, DEVICE, n_sets=1, seed=8)
    ref = reference64(inputs, inputs.ts[0], inputs.gs[0])
    impl = peers.make_impls(["ours_inplace"])[0]
    bind = impl.bind

    def copying(inputs, t, g=None):
        b = bind(inputs, t, g)
        fn = b.fn
        b.fn = lambda x: [fn(x.clone())[0]]
        return b

    monkeypatch.setattr(impl, "bind", copying)
    result = check_impl(impl, inputs, inputs.ts[0], inputs.gs[0], ref)
    assert not result.ok and "not its input's memory" in result.message


def test_ours_compiled_runs_rope_through_its_custom_op(monkeypatch):
    """`ours_compiled` times rope's kernel under torch.compile, not the reference it falls back to."""
    import rope.functional

    launched = []
    real = rope.functional._rotate
    monkeypatch.setattr(rope.functional, "_rotate", lambda *a, **k: (launched.append(1), real(*a, **k))[1])
    inputs = make_inputs(Case("c_sbhd", "sbhd", 4, 2, 2, 16, "fp32"), DEVICE, n_sets=1, seed=7)
    impl = peers.make_impls(["ours_compiled"], compile_backend="aot_eager")[0]
    bound = impl.bind(inputs, inputs.ts[0])
    bound.fn(*bound.xs)
    assert launched


@pytest.mark.parametrize("name,table", [("ours", True), ("ours_graph", False)])
def test_ours_times_the_eager_kernel_and_ours_graph_the_captured_one(monkeypatch, name, table):
    """`ours` must time the kernel eager calls run (reading the cos/sin table), `ours_graph` the one
    a user's graph capture runs (evaluating sin/cos); on a GPU both are timed by graph replay."""
    import rope.functional

    tables = []
    real = rope.functional.run
    monkeypatch.setattr(rope.functional, "run", lambda plan, p: (tables.append(plan.arg("TABLE")), real(plan, p))[1])
    inputs = make_inputs(Case("c_sbhd", "sbhd", 4, 2, 2, 16, "fp32"), DEVICE, n_sets=1, seed=8)
    impl = peers.make_impls([name])[0]
    bound = impl.bind(inputs, inputs.ts[0])
    with torch.no_grad():
        bound.fn(*bound.xs)  # eager warm-up: builds the table where one is used
        if DEVICE == "cuda":
            with impl.timing_context():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    bound.fn(*bound.xs)
        else:
            with impl.timing_context():
                bound.fn(*bound.xs)
    assert tables == [table, table]
