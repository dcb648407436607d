"""Bad input of `rope.meta` and `rope.torchtitan` (docs/contract.md sections 7c and 7d): every case raises the
exception type naming its argument first, before anything is written, and the kernel path (CUDA, or Triton's
interpreter on the CPU) and the reference path (CPU tensors without it) give that same verdict; valid calls give
the same results and gradients on both paths, and the torchtitan forms without a module agree with the forward.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

import rope._backend
import rope._launch
import rope.meta
import rope.torchtitan

from .cases import DEVICE, reference_path

B, S, HQ, HK, D, T, ROWS = 2, 3, 3, 1, 6, 4, 6


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _polar(shape, gen):
    theta = torch.rand(*shape, generator=gen) * 20 - 10
    return torch.polar(torch.ones_like(theta), theta).to(DEVICE)


def meta_args(gen):
    return dict(xq=torch.randn(B, S, HQ, D, generator=gen).to(DEVICE),
                xk=torch.randn(B, S, HK, D, generator=gen).to(DEVICE), freqs_cis=_polar((S, D // 2), gen))


def titan_args(gen, cossin=False, positions=True):
    args = dict(query=torch.randn(T, HQ, D, generator=gen).to(DEVICE),
                key=torch.randn(T, HK, D, generator=gen).to(DEVICE))
    if cossin:
        theta = torch.rand(ROWS, D // 2, generator=gen) * 20
        theta = torch.cat([theta, theta], dim=-1)
        args["cache"] = torch.cat([theta.cos(), theta.sin()], dim=-1).to(DEVICE)
    else:
        args["cache"] = _polar((ROWS, D // 2), gen)
    if positions:
        args["positions"] = torch.randint(0, ROWS, (T,), generator=gen).to(DEVICE)
    return args


def _set(**changes):
    return lambda a: {**a, **changes}


def _map(name, f):
    return lambda a: {**a, name: f(a[name])}


META = [  # (change, exception, argument named first)
    ("xq_not_tensor", _set(xq=[1.0]), TypeError, "xq"),
    ("xq_float64", _map("xq", torch.Tensor.double), TypeError, "xq"),
    ("xq_int", _map("xq", lambda x: (x * 4).long()), TypeError, "xq"),
    ("xq_3d", _map("xq", lambda x: x[0]), ValueError, "xq"),
    ("xk_dtype", _map("xk", torch.Tensor.half), TypeError, "xk"),
    ("xk_other_s", _map("xk", lambda x: x[:, :1]), ValueError, "xk"),
    ("odd_d", lambda a: {**a, "xq": a["xq"][..., :D - 1], "xk": a["xk"][..., :D - 1]}, ValueError, "xq"),
    ("freqs_not_tensor", _set(freqs_cis=None), TypeError, "freqs_cis"),
    ("freqs_real", _map("freqs_cis", torch.view_as_real), TypeError, "freqs_cis"),
    ("freqs_angles", _map("freqs_cis", torch.angle), TypeError, "freqs_cis"),
    ("freqs_complex128", _map("freqs_cis", lambda f: f.to(torch.complex128)), TypeError, "freqs_cis"),
    ("freqs_meta_device", _map("freqs_cis", lambda f: torch.empty_like(f, device="meta")), ValueError, "freqs_cis"),
    ("freqs_longer_s", _map("freqs_cis", lambda f: torch.cat([f, f[:1]])), ValueError, "freqs_cis"),
    ("freqs_shorter_s", _map("freqs_cis", lambda f: f[:-1]), ValueError, "freqs_cis"),
    ("freqs_full_width", _map("freqs_cis", lambda f: torch.cat([f, f], -1)), ValueError, "freqs_cis"),
    ("freqs_other_batch", _map("freqs_cis", lambda f: f.expand(B + 1, *f.shape)), ValueError, "freqs_cis"),
    ("freqs_broadcast_4d", _map("freqs_cis", lambda f: f.view(1, S, 1, D // 2)), ValueError, "freqs_cis"),
]

TITAN = [  # (change, exception, argument named first), for both caches
    ("query_not_tensor", _set(query=None), TypeError, "query"),
    ("query_float64", _map("query", torch.Tensor.double), TypeError, "query"),
    ("query_4d", _map("query", lambda x: x[None]), ValueError, "query"),
    ("key_dtype", _map("key", torch.Tensor.bfloat16), TypeError, "key"),
    ("key_other_tokens", _map("key", lambda x: x[1:]), ValueError, "key"),
    ("odd_h", lambda a: {**a, "query": a["query"][..., :D - 1], "key": a["key"][..., :D - 1]}, ValueError, "query"),
    ("cache_not_tensor", _set(cache=3), TypeError, "cache"),
    ("cache_float64", _map("cache", lambda c: (torch.view_as_real(c) if c.is_complex() else c).double()), TypeError,
     "cache"),
    ("cache_complex128", _map("cache", lambda c: c.to(torch.complex128)), TypeError, "cache"),
    ("cache_narrow", _map("cache", lambda c: c[:, :-1]), ValueError, "cache"),
    ("cache_3d", _map("cache", lambda c: c[:, None]), ValueError, "cache"),
    ("positions_float", _map("positions", torch.Tensor.float), TypeError, "positions"),
    ("positions_2d", _map("positions", lambda p: p[None]), ValueError, "positions"),
    ("positions_short", _map("positions", lambda p: p[1:]), ValueError, "positions"),
    ("positions_past_cache", _map("positions", lambda p: torch.cat([p[:-1], p.new_full((1,), ROWS)])), ValueError,
     "positions"),
    ("positions_negative", _map("positions", lambda p: torch.cat([p.new_full((1,), -1), p[1:]])), ValueError,
     "positions"),
    ("tokens_past_cache", lambda a: {**{n: v for n, v in a.items() if n != "positions"}, "cache": a["cache"][:T - 1]},
     ValueError, "cache"),
]

CASES = [("meta", *c) for c in META] + [(conv, *c) for conv in ("complex", "cossin") for c in TITAN]
ENTRY = {"meta": rope.meta.apply_rotary_emb, "complex": rope.torchtitan.complex_rope,
         "cossin": rope.torchtitan.cossin_rope}


def build(conv, change, seed):
    gen = _gen(seed)
    return change(meta_args(gen) if conv == "meta" else titan_args(gen, conv == "cossin"))


def verdict(conv, args):
    """(exception type, the message's first word), after checking that no tensor argument was written."""
    before = {n: v.clone() for n, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    try:
        ENTRY[conv](**args)
        got = None
    except (TypeError, ValueError) as e:
        got = (type(e), str(e).split(":")[0])
    for n, v in before.items():
        assert torch.equal(torch.view_as_real(args[n]) if v.is_complex() else args[n],
                           torch.view_as_real(v) if v.is_complex() else v), f"{n} was written by a failing call"
    return got


@pytest.mark.parametrize("conv,what,change,exc,name", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input_one_verdict(conv, what, change, exc, name):
    verdicts = []
    for reference in (False, True):
        with reference_path(reference):
            verdicts.append(verdict(conv, build(conv, change, 0)))
    assert verdicts[0] == (exc, name), f"kernel path: {verdicts[0]}, expected {exc.__name__} naming {name}"
    assert verdicts[1] == verdicts[0], f"reference path: {verdicts[1]}, kernel path: {verdicts[0]}"


def _results(conv, args, reference):
    leaves = {n: args[n].clone().requires_grad_() for n in (("xq", "xk") if conv == "meta" else ("query", "key"))}
    with reference_path(reference):
        outs = ENTRY[conv](**{**args, **leaves})
    ups = [torch.randn(o.shape, generator=_gen(7)).to(o) for o in outs]
    torch.autograd.backward(outs, ups)
    return [o.detach() for o in outs] + [v.grad for v in leaves.values()]


@pytest.mark.parametrize("conv,variant", [("meta", "seq"), ("meta", "per_token"), ("meta", "conj"),
                                          ("complex", "positions"), ("complex", "none"),
                                          ("cossin", "positions"), ("cossin", "none")])
def test_valid_calls_agree_on_both_paths(conv, variant):
    """Results and gradients of the two paths: both float32 products, rounded once to float32 (each within 2^-20 of
    the pair's scale of the exact value, accuracy.py), so within 2^-19 of each other; 1e-5 relative on N(0, 1)
    values of pair scale about 2 holds that with room."""
    gen = _gen(3)
    if conv == "meta":
        args = meta_args(gen)
        if variant == "per_token":
            args["freqs_cis"] = _polar((B, S, D // 2), gen)
        if variant == "conj":
            args["freqs_cis"] = args["freqs_cis"].conj()  # a lazily conjugated tensor: resolved, then read
    else:
        args = titan_args(gen, conv == "cossin", variant == "positions")
    kernel, ref = _results(conv, args, False), _results(conv, args, True)
    for k, r in zip(kernel, ref, strict=True):
        torch.testing.assert_close(k, r, rtol=1e-5, atol=1e-5)
    if variant == "conj":
        plain = _results(conv, {**args, "freqs_cis": args["freqs_cis"].resolve_conj()}, False)
        for k, p in zip(kernel, plain, strict=True):
            assert torch.equal(k, p)


@pytest.mark.parametrize("conv", ["complex", "cossin"])
def test_prepared_cache_forms(conv):
    """`ComplexRoPE.apply_rotary_emb` / `CosSinRoPE.apply_rotary_emb` on cache[positions] viewed [T, 1, width] equal
    the forward with positions, bitwise (the same rows in the same kernel mode); a wrong rope_cache is named."""
    args = titan_args(_gen(5), conv == "cossin")
    static = rope.torchtitan.complex_apply_rotary_emb if conv == "complex" else rope.torchtitan.cossin_apply_rotary_emb
    prepared = args["cache"][args["positions"]][:, None]
    want = ENTRY[conv](args["query"], args["key"], args["cache"][args["positions"]])
    got = static(args["query"], args["key"], prepared)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for bad, exc in ((prepared[:, 0], ValueError), (prepared[1:], ValueError), (prepared.tolist(), TypeError)):
        with pytest.raises(exc, match="^rope_cache: "):
            static(args["query"], args["key"], bad)


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the kernel path is the only one")
@pytest.mark.parametrize("conv", list(ENTRY))
@pytest.mark.parametrize("reference", [True, False])
def test_one_switch_decides(conv, reference):
    """rope._backend.on_kernel_device decides for these entry points too: the reference path launches nothing, the
    kernel path launches."""
    args = meta_args(_gen(9)) if conv == "meta" else titan_args(_gen(9), conv == "cossin")
    with reference_path(reference), mock.patch.object(rope._launch, "run", wraps=rope._launch.run) as launches:
        ENTRY[conv](**args)
    assert bool(launches.call_count) is not reference, f"{conv}: {launches.call_count} launches"
