"""torchtitan's CosSinRoPE (spec/torchtitan_common.py has what both conventions share):
    CosSinRoPE.forward(query, key, positions=None), its `cache` buffer passed in: fn(query, key, cache, positions)
cache [rows, 2H] = cat(cos, sin), each full width (torchtitan builds both halves of each from the same H/2 angles);
out = query * cos + rotate_half(query) * sin on query.float(), pairs (i, i + H/2), rounded once (type_as). The
formula reads one cos and one sin per channel, which the suite draws unequal too.
"""
from __future__ import annotations

import torch

from . import domains
from .torchtitan_common import INVARIANTS, TorchTitan, batch_rows_alone, titan_domain


class CosSin(TorchTitan):
    NAME = "torchtitan-cossin"
    INTERLEAVED = False
    CAPS = {
        **TorchTitan.CAPS,
        "table_dtypes": (True, "a cache in float16/bfloat16 (query's dtype), not only float32"),
        "elementwise_tables": (True, "cos/sin whose two halves differ (the formula reads one per channel)"),
    }

    def table_dtypes(self, caps, dtype):
        return (torch.float32, dtype) if caps["table_dtypes"] else (torch.float32,)

    def cache(self, arena, p):
        theta = arena.angles((p.rows, p.h // 2))
        theta = torch.cat([theta, theta if p.equal_halves else arena.angles(theta.shape)], dim=-1)
        return arena.place(torch.cat([torch.cos(theta), torch.sin(theta)], dim=-1).to(p.table_dtype), p.cache_layout)

    def tables64(self, cache64):
        h = cache64.shape[-1] // 2
        return cache64[:, :h], cache64[:, h:]

    def inverse_cache(self, cache):
        h = cache.shape[-1] // 2
        return torch.cat([cache[:, :h], -cache[:, h:]], dim=-1)


# batch invariance for the cos/sin form only: the complex form's own PyTorch expression (complex64 products) is not
# batch invariant on the CPU, whose vectorized loop and its remainder round a product differently (a token's key
# differed in the last bit between one token alone and two)
CosSin.INVARIANTS = {**INVARIANTS, "batch_rows_alone": batch_rows_alone}
CONVENTION = CosSin()

CosSin.DOMAIN = titan_domain((
    domains.cls("float32", lambda p, c: p.table_dtype == torch.float32),
    domains.cls("query's 16-bit dtype", lambda p, c: p.table_dtype != torch.float32, "table_dtypes",
                off=lambda caps: not caps["table_dtypes"] or set(caps["dtypes"]) <= {torch.float32}),
    domains.cls("halves equal", lambda p, c: p.equal_halves),
    domains.cls("halves differ", lambda p, c: not p.equal_halves, "elementwise_tables")))
