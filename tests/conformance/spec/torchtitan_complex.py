"""torchtitan's ComplexRoPE (spec/torchtitan_common.py has what both conventions share):
    ComplexRoPE.forward(query, key, positions=None), its `cache` buffer passed in: fn(query, key, cache, positions)
cache complex64 [rows, H/2] (torch.polar of float32 angles); pairs (2i, 2i + 1) of query and key are complex numbers
(view_as_complex) multiplied by their token's row: rope_cache = cache[positions] (or cache[:T]) viewed [T, 1, H/2].

The suite passes cache to the call as complex64 and holds it as its float32 [rows, H/2, 2] view (spec/meta.py's
ComplexCase), so that the oracle reads the table's float32 parts as given.
"""
from __future__ import annotations

from . import domains
from .meta import ComplexCase, complex_table, per_channel
from .torchtitan_common import INVARIANTS, TorchTitan, titan_domain


class Complex(TorchTitan):
    NAME = "torchtitan-complex"
    INTERLEAVED = True

    def cache(self, arena, p):
        return complex_table(arena, arena.angles((p.rows, p.h // 2)), p.cache_layout)

    def case(self, p, args, arena):
        return ComplexCase(p, args, 3, arena.buffers, complex_args=("cache",))

    def tables64(self, cache64):
        return tuple(per_channel(cache64))

    def inverse_cache(self, cache):
        conj = cache.clone()
        conj[..., 1].neg_()
        return conj


Complex.INVARIANTS = INVARIANTS
CONVENTION = Complex()

Complex.DOMAIN = titan_domain((domains.cls("complex64", lambda p, c: True),))
