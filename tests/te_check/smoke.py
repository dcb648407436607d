"""CPU smoke check of the stand-in (standin.py): `rope` through the stand-in's fused=True, run by Triton's
interpreter, against TransformerEngine's own fused=False path, forward and gradient, on small tensors.

    TE_SOURCE=/path/to/TransformerEngine TRITON_INTERPRET=1 python tests/te_check/smoke.py   (repository root)

Covers sbhd, bshd and thd; interleaved or not; partial rotation (rotary_percent 0.5); start_positions;
cp_size 2 (every rank, with and without start_positions); and packed QKV (sbhd, bshd). Every case must
pass; exit status 1 otherwise. About 3 minutes on one CPU core.
"""
import itertools
import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.te_check import standin  # noqa: E402

if not torch.cuda.is_available():
    # TE's RotaryPositionEmbedding puts inv_freq on torch.cuda.current_device(): the CPU here.
    torch.cuda.current_device = lambda: "cpu"
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("smoke.py: no CUDA device and TRITON_INTERPRET is not 1: rope would use its PyTorch reference, "
                 "not the Triton kernel")


def _interpreter_without_overflow_asserts():
    """As the repository's conftest.py does: Triton's interpreter checks every int32 add, sub and mul for
    overflow (compiled code does not); at these sizes none can happen, and the checks cost time."""
    import dataclasses

    from triton.runtime import interpreter

    options = getattr(getattr(interpreter, "interpreter_builder", None), "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False):
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_without_overflow_asserts()

from transformer_engine.pytorch.attention.rope import (  # noqa: E402  (the stand-in's modules)
    RotaryPositionEmbedding,
    apply_fused_qkv_rotary_pos_emb,
    apply_rotary_pos_emb,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
passed, failed = [], []


def run_case(name, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
        passed.append(name)
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the next case runs
        failed.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


def fwd_bwd(t, fused, **kw):
    x = t.detach().clone().requires_grad_(True)
    out = apply_rotary_pos_emb(x, fused=fused, **kw)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    (out.float() * weight).sum().backward()
    return out.detach(), x.grad


def compare(t, **kw):
    """rope (fused=True) against TE's own unfused path (fused=False): output and gradient."""
    rope_out, rope_grad = fwd_bwd(t, True, **kw)
    te_out, te_grad = fwd_bwd(t, False, **kw)
    assert rope_out.shape == t.shape and rope_out.dtype == t.dtype and rope_out.is_contiguous(), "output layout"
    torch.testing.assert_close(rope_out, te_out)
    torch.testing.assert_close(rope_grad, te_grad)


# sbhd and bshd
s, b, h, d = 8, 2, 3, 16
for fmt, interleaved, pct, cp_size, use_sp in itertools.product(
        ["sbhd", "bshd"], [False, True], [0.5, 1.0], [1, 2], [False, True]):
    emb = RotaryPositionEmbedding(d, pct, interleaved=interleaved)(s * cp_size + 4)
    t = torch.rand(s, b, h, d, device=DEV)
    if fmt == "bshd":
        t = t.transpose(0, 1).contiguous()
    sp = torch.tensor([3, 1], dtype=torch.int32, device=DEV) if use_sp else None
    for cp_rank in range(cp_size):
        run_case(f"{fmt} interleaved={interleaved} pct={pct} cp={cp_rank}/{cp_size} start_positions={use_sp}",
                 compare, t, freqs=emb, tensor_format=fmt, start_positions=sp, interleaved=interleaved,
                 cp_size=cp_size, cp_rank=cp_rank)

# thd, built as TE's test builds it (each sequence padded to a multiple of 2 * cp_size when cp_size > 1)
seq_ends = [0, 5, 9, 20, 22, 31]
for interleaved, pct, cp_size, use_sp in itertools.product([False, True], [0.5, 1.0], [1, 2], [False, True]):
    cu = [0]
    for lo, hi in itertools.pairwise(seq_ends):
        cu.append(cu[-1] + (math.ceil((hi - lo) / (2 * cp_size)) * 2 * cp_size if cp_size > 1 else hi - lo))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=DEV)
    emb = RotaryPositionEmbedding(d, pct, interleaved=interleaved)(64)
    t = torch.rand(cu[-1] // cp_size, h, d, device=DEV)
    sp = torch.randint(0, 5, (len(cu) - 1,), dtype=torch.int32, device=DEV) if use_sp else None
    for cp_rank in range(cp_size):
        run_case(f"thd interleaved={interleaved} pct={pct} cp={cp_rank}/{cp_size} start_positions={use_sp}",
                 compare, t, freqs=emb, tensor_format="thd", cu_seqlens=cu_seqlens, start_positions=sp,
                 interleaved=interleaved, cp_size=cp_size, cp_rank=cp_rank)


def compare_qkv(qkv, emb, kw):
    """The stand-in's packed QKV (rope on q and k) against TE's unfused path on the split tensors."""
    x = qkv.clone().requires_grad_(True)
    q, k, v = apply_fused_qkv_rotary_pos_emb(x, emb, emb, qkv_split_arg_list=[4 * d, d, d], **kw)
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    y = qkv.clone().requires_grad_(True)
    tq, tk, tv = torch.split(y, [4 * d, d, d], dim=3)
    tq = apply_rotary_pos_emb(tq.reshape(tq.shape[0], tq.shape[1], 4 * h, d), emb, fused=False, **kw)
    tk = apply_rotary_pos_emb(tk, emb, fused=False, **kw)
    (tq.sum() + 2 * tk.sum() + 3 * tv.sum()).backward()
    for got, want in ((q, tq), (k, tk), (v, tv)):
        assert got.shape == want.shape and got.is_contiguous(), "output layout"
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, y.grad)


for fmt, interleaved, cp_size, use_sp in itertools.product(["sbhd", "bshd"], [False, True], [1, 2], [False, True]):
    if use_sp and cp_size > 1:
        continue  # TE's packed-QKV function asserts this combination away
    emb = RotaryPositionEmbedding(d, 1.0, interleaved=interleaved)(s * cp_size + 4)
    qkv = torch.rand(s, b, h, 6 * d, device=DEV)
    if fmt == "bshd":
        qkv = qkv.transpose(0, 1).contiguous()
    sp = torch.tensor([2, 4], dtype=torch.int32, device=DEV) if use_sp else None
    for cp_rank in range(cp_size):
        kw = dict(tensor_format=fmt, start_positions=sp, interleaved=interleaved, cp_size=cp_size, cp_rank=cp_rank)
        run_case(f"packed QKV {fmt} interleaved={interleaved} cp={cp_rank}/{cp_size} start_positions={use_sp}",
                 compare_qkv, qkv, emb, kw)


def fused_path_is_rope():
    """fused=True never reaches TE's own fused code (its C extension is a stub that raises)."""
    t = torch.rand(4, 1, 1, 8, device=DEV)
    emb = RotaryPositionEmbedding(8)(4)
    try:
        standin.te_apply_rotary_pos_emb(t, emb, fused=True)
    except AttributeError as e:
        assert "te_check stand-in" in str(e), e
    else:
        raise AssertionError("TE's own fused path ran: the C-extension stub did not stop it")
    apply_rotary_pos_emb(t, emb, fused=True)


run_case("fused=True goes to rope, not to TE's C extension", fused_path_is_rope)

print(f"smoke: {len(passed)} passed, {len(failed)} failed (TE's rope.py: {standin.te_rope.__file__})")
sys.exit(1 if failed else 0)
