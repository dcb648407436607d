"""What the two conventions of RoPE fused with the KV-cache write share (spec/vllm_cache.py, spec/sglang_cache.py).

A call rotates q and k in place and stores, for each token with a slot, the rotated k and the unrotated v at that
slot; every other byte of the caches is unchanged. The suite compares the *whole* cache: `read` arranges a cache
[n_slots, h, d] as [n_slots, h, 2d], the written slots' rows in the first d channels (zeros elsewhere), the other
rows in the last d (zeros where written); `expect_cache` the float64 definition likewise. The last d channels lie
past the rotary width, so the runner compares them bitwise (accuracy.check's copied channels): the untouched slots
and every v stored with an "auto" cache, bit for bit; the rotated channels of k within the accuracy model.

FP8 (e4m3, per-tensor float32 scale): the cache holds e4m3(x / scale), x the value in the model's dtype, the
division in float32 (vLLM's conversion), saturated at +-448 and rounded to nearest even. Channels the convention
copies (k past the rotary width, v) are defined by that float32 quotient, so that the bitwise comparison of
e4m3(quotient) is exact; the rotated channels by rot64(k) / scale, within the model: one rounding to the model's
dtype and one to e4m3 (relative 2^-4), inside EPS[e4m3] = 2^-3 (its mantissa has 3 bits); ETA[e4m3] = 2^-10 is
half its subnormal spacing 2^-9.
"""
from __future__ import annotations

import torch

from .. import accuracy, pairing
from . import Convention, Expect

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# e4m3's unit roundoff and underflow grid (the module docstring); registered for the accuracy checks of fp8 caches.
accuracy.EPS.setdefault(FP8, 2.0**-3)
accuracy.ETA.setdefault(FP8, 2.0**-10)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
SCALES = (1.0, 0.25, 0.0375, 0.004)  # 0.004: |x| / scale beyond 448 for |x| > 1.8, so saturation is drawn


def slots_for(gen, n_given: int, n_slots: int, n_padded: int, dtype) -> torch.Tensor:
    """n_given distinct slots of [0, n_slots) (n_given <= n_slots) in random order, n_padded of them -1."""
    slots = torch.randperm(n_slots, generator=gen)[:n_given]
    if n_padded:
        slots[torch.randperm(n_given, generator=gen)[:n_padded]] = -1
    return slots.to(dtype)


def written(slots: torch.Tensor, n_slots: int):
    """(a mask over the n_slots slots: written, the token that writes each slot (0 where none))."""
    slots = slots.long().cpu()
    ok = (slots >= 0) & (slots < n_slots)
    mask = torch.zeros(n_slots, dtype=torch.bool)
    token = torch.zeros(n_slots, dtype=torch.long)
    mask[slots[ok]] = True
    token[slots[ok]] = torch.arange(slots.shape[0])[ok]
    return mask, token


def _bits(x):
    return x.contiguous().view(_BITS[x.element_size()])


def read(cache: torch.Tensor, mask: torch.Tensor, shape: tuple) -> torch.Tensor:
    """cache as [n_slots, h, 2d]: written rows in the first d channels, the others in the last d (zeros elsewhere,
    bitwise, in the cache's dtype)."""
    b = _bits(cache.detach().cpu().reshape(shape))
    m = mask[:, None, None]
    zero = torch.zeros_like(b)
    return torch.cat([torch.where(m, b, zero), torch.where(m, zero, b)], dim=-1).view(cache.dtype)


def stored(x64: torch.Tensor, scale, fp8: bool) -> torch.Tensor:
    """What the cache holds for x (float64, the model's dtype values as given) where the convention copies it:
    x itself, or its float32 quotient by the scale, saturated."""
    if not fp8:
        return x64
    return (x64.float() / torch.tensor(float(scale), dtype=torch.float32)).clamp(-FP8_MAX, FP8_MAX).double()


def expect_cache(old64, mask, token, x64, rot, interleaved, scale, fp8, model_dtype, cache_dtype, source64=None):
    """The Expect of a whole cache (old64 [n_slots, h, d], as given) after the call: at a written slot the value of
    its token's x64 (rotated: rot64(k), or v: rot 0) as the cache stores it. `source64`: the pre-rotation input of
    x64 (the accuracy scale; None: x64 is a copy)."""
    from . import Expect

    n, h, d = old64.shape
    # [n_slots, h, d]; rows of unwritten slots are discarded below (all of them without tokens: x64 has no row)
    new = x64[token] if x64.shape[0] else x64.new_zeros(n, h, d)
    src = (new if source64 is None else source64[token] if x64.shape[0] else new).clone()
    if fp8:
        s = float(scale)
        head = (new[..., :rot] / s).clamp(-FP8_MAX, FP8_MAX)
        new = torch.cat([head, stored(new[..., rot:], s, True)], dim=-1)
        src = src / s
    m = mask[:, None, None]
    value = torch.cat([torch.where(m, new, 0.0), torch.where(m, 0.0, old64)], dim=-1)
    source = torch.cat([torch.where(m, src, 0.0), torch.zeros_like(old64)], dim=-1)
    return Expect(value, source, rot, interleaved, cache_dtype)


def rotate64(x64, rows64, rot, is_neox):
    """x [T, h, d] (float64) rotated at each token's cos_sin_cache row [T, rot] (cos half, sin half)."""
    half = rot // 2
    cos, sin = (pairing.per_channel(t, not is_neox).unsqueeze(-2) for t in (rows64[:, :half], rows64[:, half:]))
    return pairing.rotate(x64, cos, sin, not is_neox)


def cache_bits(cache) -> torch.Tensor:
    """The cache's bytes as integers, on the CPU (for bitwise comparisons of caches of any dtype)."""
    return _bits(cache.detach().cpu())


class KVCacheConvention(Convention):
    """What both forms define once their arguments are named (ARGS: q, k, v, kc, vc, slots -> the signature's
    names) and their plans hold t, hk, d, rot, is_neox, fp8, scales, dtype and n_slots: q and k rotated in place,
    the caches written at the slots, None returned."""
    ARGS: dict = {}

    def effects(self, case):
        a = self.ARGS
        return (a["q"], a["k"], a["kc"], a["vc"]), None

    def head_count(self, p, name) -> int:
        """q's heads (hq) or k's and v's (hk): a reshape to [T, h, d] names it (with T = 0, -1 could be any)."""
        return p.hq if name == self.ARGS["q"] else p.hk

    def with_tokens(self, p, t: int):
        """The plan with t >= p.t tokens, the added ones given slots of their own (a short mapping stays as much
        shorter than the tokens) and the caches grown to hold them."""
        raise NotImplementedError

    def heads(self, case, name, t):
        return t.reshape(case.plan.t, self.head_count(case.plan, name), case.plan.d)

    def read(self, case, name, t):
        p, a = case.plan, self.ARGS
        if name in (a["kc"], a["vc"]):
            return read(t, written(case.args[a["slots"]], p.n_slots)[0], (p.n_slots, p.hk, p.d))
        return self.heads(case, name, t)

    def define(self, case, x64):
        p, a = case.plan, self.ARGS
        rows = x64["cos_sin_cache"][x64["positions"]]
        q, k, v = (x64[a[n]].reshape(p.t, self.head_count(p, a[n]), p.d) for n in ("q", "k", "v"))
        q_rot, k_rot = rotate64(q, rows, p.rot, p.is_neox), rotate64(k, rows, p.rot, p.is_neox)
        mask, token = written(x64[a["slots"]], p.n_slots)
        cdt = FP8 if p.fp8 else p.dtype
        old = {n: x64[a[n]].reshape(p.n_slots, p.hk, p.d) for n in ("kc", "vc")}
        return {
            a["q"]: Expect(q_rot, q, p.rot, not p.is_neox, p.dtype),
            a["k"]: Expect(k_rot, k, p.rot, not p.is_neox, p.dtype),
            a["kc"]: expect_cache(old["kc"], mask, token, k_rot, p.rot, not p.is_neox, p.scales[0], p.fp8, p.dtype,
                                  cdt, k),
            a["vc"]: expect_cache(old["vc"], mask, token, v, 0, False, p.scales[1], p.fp8, p.dtype, cdt),
        }
