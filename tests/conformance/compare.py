"""Comparisons the convention invariants share: bitwise, within N roundings, and the inverse rotation."""
from __future__ import annotations

import torch

from . import accuracy, pairing
from .contract import bits


def _first(bad, what, got, want, extra=""):
    idx = tuple(int(i) for i in bad.nonzero()[0])
    raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first at {idx}: "
                         f"{got[idx].item()!r} against {want[idx].item()!r}{extra}")


def assert_bitwise(what, got, want):
    """Bitwise equal (NaN payloads and signed zeros included): two calls that must compute the same expressions
    on the same values, however the arguments lie in memory."""
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    got, want = got.detach().cpu(), want.detach().cpu()
    assert tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype, \
        f"{what}: {tuple(got.shape)} {got.dtype} against {tuple(want.shape)} {want.dtype}"
    bad = bits(got) != bits(want)
    if bad.any():
        _first(bad, what, got, want)


def assert_within(what, got, want, source, rot: int, interleaved: bool, roundings: float, model: str):
    """got within `roundings` times the accuracy model's bound of `want` (a result that may differ from got in
    the order of operations, or a float64 value `roundings` calls away), the bound's pair scale taken from
    `source`; channels past the rotary width (copies) bitwise equal to want rounded to got's dtype."""
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} against {tuple(w.shape)}"
    scale = pairing.pair_scale(source.detach().cpu(), rot, interleaved)
    bad = ~((g - w).abs() <= roundings * accuracy.bound(w, scale, got.dtype, model))  # NaN fails
    bad[..., rot:] = g[..., rot:] != w[..., rot:].to(got.dtype).double()
    if bad.any():
        _first(bad, what, g, w, f" (beyond {roundings} roundings, dtype {got.dtype})")


def assert_undone(what, back, x0, rot: int, interleaved: bool, table_dtype, model: str):
    """`back`, the call with -sin applied to the call's result, gives back x0.

    The tables are the exact cos/sin rounded to their dtype T: c~ = c(1 + d1), s~ = s(1 + d2), |d| <= EPS[T]/2,
    so c~^2 + s~^2 differs from 1 by up to EPS[T] (2 EPS[T] allowed): R(-theta) R(theta) = (c~^2 + s~^2) I on a
    pair of scale s = |x_i| + |x_p|. Each call errs by at most B(s) = accuracy.bound(s, s, D, model) per element;
    the second carries the first's error of both pair members (2 B) and adds its own on a pair of scale up to
    2 s (2 B): 4 B(s) in all. Channels past the rotary width are copied twice: bitwise."""
    back, x0 = back.detach().cpu(), x0.detach().cpu()
    s = pairing.pair_scale(x0, rot, interleaved)
    tol = 2 * accuracy.EPS[table_dtype] * s + 4 * accuracy.bound(s, s, back.dtype, model)
    bad = ~((back.double() - x0.double()).abs() <= tol)
    bad[..., rot:] = bits(back[..., rot:]) != bits(x0[..., rot:])
    if bad.any():
        _first(bad, f"{what}: the call with -sin does not undo the call", back, x0)
