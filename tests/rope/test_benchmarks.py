"""The benchmark suite's parts on the CPU (benchmarks/ is not a package: its modules are imported from
there): the case list, the float64 check that every implementation passes before it is timed, the
peer adapters against stand-ins that follow each library's documented semantics, and the report
script on a small synthetic pytest-benchmark JSON. Nothing here times anything.
"""
from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from cases import CASES, Case, make_inputs  # noqa: E402
from checks import check_impl, reference64  # noqa: E402
from peers import IMPLS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_case_list_is_well_formed():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    by_name = {c.name: c for c in CASES}
    for c in CASES:
        assert c.fmt in ("sbhd", "bshd", "thd") and c.d2 <= c.d and c.d2 % 2 == 0
        assert (c.fmt == "thd") == bool(c.seqlens) and c.bytes_fwd > 2 * c.numel * c.elem_bytes
    # the shapes the issue names
    for name, dtype in (("headline_bf16", "bf16"), ("headline_fp32", "fp32")):
        assert by_name[name].shapes == [(2048, 16, 8, 256)] and by_name[name].dtype == dtype
    assert by_name["llama_sbhd"].shapes == [(4096, 2, 32, 128)]
    assert by_name["llama_bshd"].shapes == [(2, 4096, 32, 128)]
    assert [(c.shapes, c.dtype) for c in CASES if c.name.startswith("small_")] == [
        ([(64, 1, 16, 64)], "fp32"), ([(128, 1, 16, 128)], "fp32"), ([(32, 1, 8, 256)], "fp32")]
    partial = by_name["partial"]
    assert partial.d2 == 64 and partial.bytes_fwd == 2 * partial.numel * 2 + 4096 * 64 * 4  # the tail counts
    thd, twin = by_name["thd_short"], by_name["bshd_2048x8"]
    assert thd.numel == twin.numel and thd.bytes_fwd == 2 * thd.numel * 2 + 8 * 128 * 4  # the longest sequence's rows
    decode = by_name["decode"]
    assert decode.shapes == [(1, 64, 32, 128)] and decode.bytes_fwd == 2 * decode.numel * 2 + 64 * 128 * 4
    gqa = by_name["qk_llama_gqa"]  # q and k both read and written, the angle rows once
    assert gqa.kind == "qk" and gqa.shapes == [(4096, 2, 32, 128), (4096, 2, 8, 128)]
    assert gqa.bytes_fwd == 2 * 4096 * 2 * (32 + 8) * 128 * 2 + 4096 * 128 * 4
    inplace = by_name["llama_inplace"]
    assert inplace.kind == "inplace" and inplace.shapes == by_name["llama_sbhd"].shapes
    for case in CASES:  # every kind of case has implementations of ours to time
        assert any(case.kind in cls.kinds and cls.ours for cls in IMPLS.values()), case.name


SMALL_CASES = [
    Case("a_sbhd", "sbhd", 6, 2, 4, 16, "fp32"),
    Case("a_bshd_bf16", "bshd", 5, 2, 2, 16, "bf16"),
    Case("a_sbhd_partial", "sbhd", 4, 2, 2, 16, "fp16", rot_dim=8),
    Case("a_interleaved", "bshd", 4, 3, 2, 16, "fp32", interleaved=True),
    Case("a_thd", "thd", 0, 1, 2, 16, "fp32", seqlens=(3, 0, 5, 2)),
    Case("a_decode", "sbhd", 1, 3, 4, 16, "fp32", start_max=20),
    Case("a_qk", "sbhd", 5, 2, 4, 16, "bf16", hk=2),
    Case("a_qk_thd", "thd", 0, 1, 4, 16, "fp32", hk=1, seqlens=(3, 5), rot_dim=8),
    Case("a_inplace", "thd", 0, 1, 2, 16, "fp32", inplace=True, seqlens=(3, 5)),
]


def _checked(name, case, seed=0, **attrs):
    inputs = make_inputs(case, DEVICE, n_sets=1, seed=seed)
    impl = IMPLS[name]()
    for key, value in attrs.items():
        setattr(impl, key, value)
    t, g = inputs.ts[0], inputs.gs[0]
    before = [x.clone() for x in (t if isinstance(t, tuple) else (t,))]
    result = check_impl(impl, inputs, t, g, reference64(inputs, t, g))
    after = t if isinstance(t, tuple) else (t,)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), f"{name}: the shared set was modified"
    return result


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: c.name)
def test_check_accepts_rope_and_the_reference(case):
    for name in ("ours", "ours_qk", "ours_2x", "ours_inplace", "reference", "compile"):
        impl = IMPLS[name]()
        if case.kind not in impl.kinds or impl.unsupported(case):
            continue
        result = _checked(name, case, backend="aot_eager")  # torch.compile without a C++ toolchain on CPU
        assert result.ok, (name, case.name, result.message)
        assert (result.bwd_err is None) == (name == "ours_inplace")


def test_check_rejects_a_wrong_implementation(monkeypatch):
    import rope

    real = rope.apply_rotary_pos_emb
    monkeypatch.setattr(rope, "apply_rotary_pos_emb", lambda t, freqs, *a, **k: real(t, -freqs, *a, **k))
    result = _checked("ours", SMALL_CASES[0])  # the sine's sign flipped
    assert not result.ok and result.fwd_err > 0.1 and "relative error forward" in result.message
    monkeypatch.setattr(rope, "apply_rotary_pos_emb", lambda t, *a, **k: real(t, *a, **k).clone() * 1.001)
    assert not _checked("ours", SMALL_CASES[0]).ok  # off by more than rounding in float32
    monkeypatch.setattr(rope, "apply_rotary_pos_emb", lambda t, *a, inplace=False, **k: real(t.clone(), *a, **k))
    result = _checked("ours_inplace", SMALL_CASES[-1])  # right values, but not in the input's memory
    assert not result.ok and "not its input's memory" in result.message

    def wrong_k(q, k, *a, **kw):
        q_out, k_out = real_qk(q, k, *a, **kw)
        return q_out, k_out.flip(0)

    real_qk = rope.apply_rotary_pos_emb_qk
    monkeypatch.setattr(rope, "apply_rotary_pos_emb_qk", wrong_k)
    assert not _checked("ours_qk", SMALL_CASES[6]).ok


# ---- stand-ins for the optional peers, written from their documented semantics -----------------

def _rotate(x, cos, sin, interleaved, sign):
    """x [..., r] rotated by half-angle tables cos/sin [..., r/2] (flash-attn's convention)."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    a, b = x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin
    return torch.stack((a, b), dim=-1).flatten(-2) if interleaved else torch.cat((a, b), dim=-1)


def _flash_apply(x, cos, sin, interleaved, offsets, cu, sign):
    assert x.dtype == cos.dtype == sin.dtype, "Input and cos/sin must have the same dtype"
    r = 2 * cos.shape[1]
    if cu is None:
        dev = x.device
        pos = torch.arange(x.shape[1], device=dev)[None, :] + (offsets.long()[:, None] if torch.is_tensor(offsets)
                                                                else offsets)
    else:
        lens = (cu[1:] - cu[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens)
        pos = torch.arange(x.shape[0], device=x.device) - cu.long()[seq]
    c, s = cos.float()[pos].unsqueeze(-2), sin.float()[pos].unsqueeze(-2)
    out = x.clone()
    out[..., :r] = _rotate(x[..., :r].float(), c, s, interleaved, sign).to(x.dtype)
    return out


class _Flash(torch.autograd.Function):
    """flash_attn.layers.rotary.apply_rotary_emb: x (b, s, h, d) or (total, h, d) with cu_seqlens, cos/sin
    (seqlen, rotary_dim / 2) in x's dtype, seqlen_offsets an int or (b,); backward: sin negated."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, offsets, cu):
        ctx.args = (cos, sin, interleaved, offsets, cu)
        return _flash_apply(x, cos, sin, interleaved, offsets, cu, 1.0)

    @staticmethod
    def backward(ctx, g):
        return _flash_apply(g, *ctx.args, -1.0), *([None] * 5)


def flash_apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                           max_seqlen=None):
    assert not inplace and (cu_seqlens is None or max_seqlen is not None)
    return _Flash.apply(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens)


def _liger_inplace(v, cos, sin, sign):
    phys = v.transpose(1, 2).contiguous()  # [b, s, h, d]: no copy for projection outputs, then written in place
    half = phys.shape[-1] // 2
    with torch.no_grad():
        phys.copy_(_rotate(phys.to(cos.dtype), cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2), False, sign))
    return phys.transpose(1, 2)


class _Liger(torch.autograd.Function):
    """liger_rotary_pos_emb: q (b, hq, s, d), k (b, hk, s, d), cos/sin (1 or b, s, d) with duplicated halves;
    works on q.transpose(1, 2).contiguous() in place, in cos's dtype; backward: the same with sin negated."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _liger_inplace(q, cos, sin, 1.0), _liger_inplace(k, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return _liger_inplace(dq, cos, sin, -1.0), _liger_inplace(dk, cos, sin, -1.0), None, None


def _te_apply(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=False, cu_seqlens=None):
    from rope import reference

    return reference.apply_rotary_pos_emb(t, freqs, tensor_format, start_positions, interleaved, False, cu_seqlens)


@pytest.fixture
def fake_peers(monkeypatch):
    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)

    for name in ("flash_attn", "flash_attn.layers", "liger_kernel", "liger_kernel.transformers", "transformer_engine",
                 "transformer_engine.pytorch", "transformer_engine.pytorch.attention"):
        module(name)
    module("flash_attn.layers.rotary", apply_rotary_emb=flash_apply_rotary_emb)
    module("liger_kernel.transformers.rope", liger_rotary_pos_emb=lambda q, k, cos, sin: _Liger.apply(q, k, cos, sin))
    module("transformer_engine.pytorch.attention.rope", apply_rotary_pos_emb=_te_apply)


@pytest.mark.parametrize("case", [c for c in SMALL_CASES if c.kind == "t"], ids=lambda c: c.name)
def test_peer_adapters_agree_with_float64(fake_peers, case):
    """Each adapter's layout conversion (views, the q/k split, cos/sin tables, offsets) is right, on the import
    paths of tests/conformance/registry.py (a peer the registry has no call of is named as such, and not run)."""
    for name in ("te", "flash", "liger"):
        impl = IMPLS[name]()
        if not impl.candidates:
            assert name == "te" and "registry.py has no te call of te" in impl.missing(), impl.missing()
            continue
        assert impl.missing() is None
        if IMPLS[name]().unsupported(case):
            assert name == "liger" and (case.fmt == "thd" or case.interleaved or case.d2 != case.d)
            continue
        result = _checked(name, case, seed=3)
        assert result.ok, (name, case.name, result.message)


def test_a_wrong_or_missing_peer_is_caught(fake_peers, monkeypatch):
    rotary = sys.modules["flash_attn.layers.rotary"]
    monkeypatch.setattr(rotary, "apply_rotary_emb", lambda x, cos, sin, **k: flash_apply_rotary_emb(x, cos, -sin, **k))
    result = _checked("flash", SMALL_CASES[0])
    assert not result.ok and result.fwd_err > 0.1
    monkeypatch.setitem(sys.modules, "flash_attn.layers.rotary", None)  # an import that fails
    assert "cannot import" in IMPLS["flash"]().missing()


# ---- the report ------------------------------------------------------------------------------------

def _bench(case, impl, mode, us, gpu_us, clone_us=None, clone_gpu=None, nbytes=4_000_000, copy=2000.0):
    info = dict(case=case, label=f"sbhd {case}", impl=impl, mode=mode, bytes=nbytes, copy_gbps=copy, us=us,
                gbps=nbytes / us / 1e3, frac_copy=nbytes / us / 1e3 / copy, gpu_us=gpu_us,
                gpu_gbps=gpu_us and nbytes / gpu_us / 1e3, gpu_frac_copy=gpu_us and nbytes / gpu_us / 1e3 / copy,
                x_clone=clone_us and us / clone_us, gpu_x_clone=clone_gpu and gpu_us and gpu_us / clone_gpu)
    return {"name": f"test_rope[{case}-{impl}-{mode}]", "group": case, "stats": {"median": us * 1e-6},
            "extra_info": info}


def test_report_writes_the_table_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    benchmarks = [
        _bench("big", "clone", "fwd", 2.5, 2.2),
        _bench("big", "ours", "fwd", 2.6, 2.25, 2.5, 2.2),
        _bench("big", "ours", "bwd", 2.7, 2.5, 2.5, 2.2),
        _bench("big", "reference", "fwd", 20.0, None, 2.5, 2.2),  # not captured: % of copy from the eager time
        _bench("tiny", "clone", "fwd", 8.0, 1.0, nbytes=4096),
        _bench("tiny", "ours", "fwd", 12.0, 1.25, 8.0, 1.0, nbytes=4096),
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"machine_info": {"gpu": {"name": "Fake GPU"}, "torch": "2.x", "triton": "3.x"},
                                "benchmarks": benchmarks}))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "table.md").read_text()
    assert "Fake GPU" in text and "copy bandwidth 2000 GB/s" in text
    rows = {tuple(cell.strip() for cell in line.split("|")[1:5]): [c.strip() for c in line.split("|")[5:-1]]
            for line in text.splitlines() if line.startswith("| big") or line.startswith("| tiny")}
    # µs, GPU µs, GB/s, % copy, x clone, GPU x clone: 4 MB in 2.25 µs is 1778 GB/s, 88.9 % of 2000
    assert rows[("big", "sbhd big", "ours", "fwd")] == ["2.60", "2.25", "1778", "88.9", "1.04", "1.02"]
    assert rows[("big", "sbhd big", "reference", "fwd")] == ["20.00", "-", "200*", "10.0*", "8.00", "-"]
    assert rows[("tiny", "sbhd tiny", "ours", "fwd")][4:] == ["1.50", "1.25"]
    for name in ("copy_fwd.png", "copy_bwd.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
