"""rope.qknorm.apply_freqs beyond the native suite (tests/conformance, convention te-qknorm): bad input refused by
name before anything is written with one verdict on the kernel and reference paths, both paths against the float64
definition (norm, then TransformerEngine's rotation: tests/conformance/te_oracle.py) in value and in every gradient,
inputs left as they were and outputs new, a RoPECache read like its freqs, and empty input."""
from __future__ import annotations

import pytest
import torch

import rope
import rope._backend
from rope import qknorm
from tests.conformance import accuracy, te_oracle
from tests.conformance.spec import qknorm_math

from .cases import DEVICE, cu_seqlens_of, reference_path

D, ROT, EPS = 10, 6, 1e-6


def _args(fmt="sbhd", dtype=torch.float32, seed=0, lengths=(2, 0, 3), start=False, cp=1, rank=0, **over):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(DEVICE)

    s = 2 if cp > 1 else 3  # context parallel: two chunks per sequence
    lead = {"sbhd": (s, 2), "bshd": (2, s)}.get(fmt, (sum(lengths) // cp,))
    n = len(lengths) if fmt == "thd" else 2
    args = dict(q=r(*lead, 3, D).to(dtype), k=r(*lead, 2, D).to(dtype), q_weight=r(D), k_weight=r(D),
                freqs=r(16, 1, 1, ROT, scale=8.0), tensor_format=fmt,
                start_positions=torch.randint(0, 4, (n,), generator=gen, dtype=torch.int32).to(DEVICE) if start
                else None, cu_seqlens=cu_seqlens_of(lengths) if fmt == "thd" else None, cp_size=cp, cp_rank=rank,
                eps=EPS)
    args.update(over)
    return args


def _want(x, w, a, gemma=False, interleaved=False):
    """The float64 definition: RMSNorm(x) w (qknorm_math), then TransformerEngine's rotation (te_oracle)."""
    n = qknorm_math.norm(x, w, EPS, gemma)[2]
    return te_oracle.apply_rotary_pos_emb(n, a["freqs"], a["tensor_format"], a["start_positions"], interleaved,
                                          True, a["cu_seqlens"], a["cp_size"], a["cp_rank"])


BAD = [
    ("q", TypeError, lambda a: dict(q=a["q"].double())),
    ("k", TypeError, lambda a: dict(k=a["k"].double())),
    ("k", ValueError, lambda a: dict(k=a["k"][..., :8])),
    ("q_weight", ValueError, lambda a: dict(q_weight=a["q_weight"][:8])),
    ("k_weight", TypeError, lambda a: dict(k_weight=a["k_weight"].double())),
    ("k_weight", TypeError, lambda a: dict(k_weight=[1.0] * D)),
    ("q_weight", ValueError, lambda a: dict(q_weight=torch.randn(D, device="meta"))),
    ("eps", ValueError, lambda a: dict(eps=0.0)),
    ("eps", ValueError, lambda a: dict(eps=-1e-6)),
    ("eps", ValueError, lambda a: dict(eps=float("nan"))),
    ("gemma", TypeError, lambda a: dict(gemma="yes")),
    ("interleaved", TypeError, lambda a: dict(interleaved=1)),
    ("tensor_format", ValueError, lambda a: dict(tensor_format="sbdh")),
    ("freqs", ValueError, lambda a: dict(freqs=a["freqs"].new_zeros(16, 1, 1, D + 2))),
    ("freqs", ValueError, lambda a: dict(freqs=a["freqs"][:2])),
    ("freqs", TypeError, lambda a: dict(freqs=a["freqs"].int())),
    ("cu_seqlens", ValueError, lambda a: dict(cu_seqlens=cu_seqlens_of([1]))),
    ("start_positions", ValueError, lambda a: dict(start_positions=torch.zeros(3, dtype=torch.int32,
                                                                               device=DEVICE))),
    ("start_positions", ValueError, lambda a: dict(start_positions=torch.tensor([0, -1], device=DEVICE))),
    ("cp_rank", ValueError, lambda a: dict(cp_size=2, cp_rank=2)),
]


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("name,exc,over", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_bad_input_one_verdict_before_writing(name, exc, over, reference):
    a = _args()
    a.update(over(a))
    before = {n: v.clone() for n, v in a.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with reference_path(reference), pytest.raises(exc) as err:
        qknorm.apply_freqs(**a)
    assert str(err.value).startswith(name), str(err.value)
    for n, v in before.items():
        assert torch.equal(a[n], v), f"{n} was written before the error"


def test_thd_bad_cu_seqlens_one_verdict():
    a = _args("thd", cu_seqlens=cu_seqlens_of([2, 0, 2]))  # ends short of the 5 tokens
    for reference in (False, True):
        with reference_path(reference), pytest.raises(ValueError, match="^cu_seqlens"):
            qknorm.apply_freqs(**a)


CASES = [
    dict(fmt="sbhd"),
    dict(fmt="bshd", start=True, gemma=True, interleaved=True),
    dict(fmt="thd", start=True),
    dict(fmt="thd", lengths=(4, 0, 8), cp=2, rank=1),
    dict(fmt="sbhd", cp=2, rank=0, start=True, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_against_float64_in_value_and_gradients(case, reference):
    """Forward and the gradients of q, k and both weights against the float64 definition's, within qknorm_math's
    accuracy model (float32 math, one rounding to the dtype; the scales are the error arguments there); inputs left
    bitwise as they were, outputs new tensors."""
    case = dict(case)
    gemma, interleaved = case.pop("gemma", False), case.pop("interleaved", False)
    a = _args(**case, gemma=gemma, interleaved=interleaved)
    dtype = a["q"].dtype
    leaves = {n: a[n].clone().requires_grad_() for n in ("q", "k", "q_weight", "k_weight")}
    before = {n: v.detach().clone() for n, v in leaves.items()}
    with reference_path(reference):
        out = qknorm.apply_freqs(**{**a, **leaves})
    gen = torch.Generator().manual_seed(7)
    ups = [torch.randn(o.shape, generator=gen).to(dtype).to(DEVICE) for o in out]
    torch.autograd.backward(out, ups)
    x64 = {n: v.detach().cpu().double().requires_grad_() for n, v in before.items()}
    a64 = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    want = [_want(x64[x], x64[f"{x}_weight"], a64, gemma, interleaved) for x in ("q", "k")]
    grads = torch.autograd.grad(want, list(x64.values()), [u.cpu().double() for u in ups])
    for name, o, w, u in zip(("q", "k"), out, want, ups, strict=True):
        x, wt = before[name].cpu(), before[f"{name}_weight"].cpu()
        assert all(o.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for v in leaves.values())
        accuracy.check(f"{name}", o, w, qknorm_math.forward_source(x, wt, EPS, gemma, ROT, interleaved), dtype)
        g = dict(zip(x64, grads, strict=True))
        up = u.cpu().double()
        accuracy.check(f"grad {name}", leaves[name].grad, g[name],
                       qknorm_math.input_grad_scale(up, x, wt, EPS, gemma, ROT, interleaved), dtype)
        accuracy.check(f"grad {name}_weight", leaves[f"{name}_weight"].grad, g[f"{name}_weight"],
                       qknorm_math.weight_grad_scale(up, x, wt, EPS, gemma, ROT, interleaved), torch.float32)
    for n, v in before.items():
        assert torch.equal(leaves[n].detach(), v), f"{n} was modified"


def test_rope_cache_reads_like_its_freqs():
    """A RoPECache of freqs (float32 tables: cos and sin of the float32 angles, within the 2^-20 of the model's
    rotation term) gives freqs' float64 result within the same accuracy model, on both paths."""
    a = _args("thd", start=True)
    cache = rope.RoPECache.from_freqs(a["freqs"])
    a64 = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    for reference in (False, True):
        with reference_path(reference):
            got = qknorm.apply_freqs(**{**a, "freqs": cache})
        for name, g in zip(("q", "k"), got, strict=True):
            x, w = a64[name], a64[f"{name}_weight"]
            accuracy.check(f"{name} through a RoPECache", g, _want(x, w, a64),
                           qknorm_math.forward_source(x, w, EPS, False, ROT, False), torch.float32)


def test_empty():
    a = _args("thd", lengths=(0, 0))
    leaves = {n: a[n].clone().requires_grad_() for n in ("q", "k", "q_weight", "k_weight")}
    out = qknorm.apply_freqs(**{**a, **leaves})
    assert [tuple(o.shape) for o in out] == [(0, 3, D), (0, 2, D)]
    sum(o.sum() for o in out).backward()
    assert torch.equal(leaves["q_weight"].grad, torch.zeros(D, device=DEVICE))
