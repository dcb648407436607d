"""pytest-benchmark: RoPE fused with the KV-cache write (`rope.serving.rope_and_cache`) against the unfused pairs.

    pytest benchmarks/bench_serving.py --benchmark-only --benchmark-json=$OUT/serving.json

Cases: 32 query / 8 key-value heads, d 128, bf16, vLLM's cache [num_blocks, 16, 8, 128] in bf16 ("auto") or
float8_e4m3fn ("fp8", per-tensor scales); decode of 64 and 256 sequences (one token each) and a prefill of 4096
tokens, every token with a slot. Implementations:
- `fused`: one launch;
- `rope_alone`: rope.vllm.rotary_embedding only (no cache write: the floor the fusion is measured against);
- `unfused`: rope.vllm.rotary_embedding, then the index write in PyTorch (`key_cache.view(-1, h, d)[slots] = key`,
  as vLLM's reshape_and_cache stores it; fp8: x / scale in float32, saturated, stored as e4m3);
- `liger`: Liger's RoPE (the tokens as one sequence, q [1, h, T, d], with the rows of cos/sin gathered at the
  positions as bf16 tables [1, T, d]) then the same write (`pip install liger-kernel`).
Each is first checked against the fused op (v bitwise; k within two roundings of the cache's dtype: each kernel
rounds its own rotation), then
timed eagerly (pytest-benchmark, a synchronizing clock) and as CUDA-graph replays (bench_rope.gpu_us; extra_info
gpu_us). Without a GPU every case is collected and skipped.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from timing import cuda_sync_clock

import rope.serving
import rope.vllm

HQ, HK, D, BLOCK = 32, 8, 128, 16
SHAPES = {"decode64": 64, "decode256": 256, "prefill4k": 4096}
CACHES = ("auto", "fp8")
IMPLS = ("fused", "rope_alone", "unfused", "liger")
CASES = [(s, c, i) for s in SHAPES for c in CACHES for i in IMPLS]
FP8 = torch.float8_e4m3fn


pytestmark = pytest.mark.benchmark(timer=cuda_sync_clock, disable_gc=True)


def inputs(tokens, cache):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def r(*size):
        return torch.randn(size, generator=gen, device="cuda").to(torch.bfloat16)

    rows = 8192
    theta = torch.rand(rows, D // 2, generator=gen, device="cuda") * 1000
    n_blocks = 2 * tokens // BLOCK + 8
    cdt = FP8 if cache == "fp8" else torch.bfloat16
    return dict(positions=torch.randint(0, rows, (tokens,), generator=gen, device="cuda"), query=r(tokens, HQ * D),
                key=r(tokens, HK * D), value=r(tokens, HK, D), key_cache=r(n_blocks, BLOCK, HK, D).to(cdt),
                value_cache=r(n_blocks, BLOCK, HK, D).to(cdt),
                slot_mapping=torch.randperm(n_blocks * BLOCK, generator=gen, device="cuda")[:tokens],
                cos_sin_cache=torch.cat([theta.cos(), theta.sin()], -1), is_neox=True, kv_cache_dtype=cache,
                k_scale=torch.tensor([0.05], device="cuda"), v_scale=torch.tensor([0.04], device="cuda"))


def index_write(a, key):
    """vLLM's reshape_and_cache as PyTorch: each token's k and v at its slot (fp8 as bytes: e4m3 has no index_put)."""
    slots = a["slot_mapping"]
    for cache, x, scale in ((a["key_cache"], key.view(-1, HK, D), a["k_scale"]), (a["value_cache"], a["value"],
                                                                                   a["v_scale"])):
        if cache.dtype == FP8:
            x = (x.float() / scale).clamp(-448.0, 448.0).to(FP8).view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, HK, D)[slots] = x


def liger_rope():
    fn = importlib.import_module("liger_kernel.transformers.rope").liger_rotary_pos_emb

    def run(a):
        t = a["positions"].shape[0]
        rows = a["cos_sin_cache"][a["positions"]]
        # the tokens as one sequence of T rows, as Liger takes them: q [1, h, T, d], tables [1, T, d] (Liger reads one
        # table row per sequence position, not per batch entry)
        cos, sin = (torch.cat([h, h], -1).to(torch.bfloat16)[None] for h in rows.chunk(2, -1))
        q, k = fn(a["query"].view(1, t, HQ, D).transpose(1, 2), a["key"].view(1, t, HK, D).transpose(1, 2), cos, sin)
        return q, k.transpose(1, 2).reshape(t, HK * D)
    return run


def path(impl):
    if impl == "fused":
        return lambda a: rope.serving.rope_and_cache(**a)
    if impl == "rope_alone":
        return lambda a: rope.vllm.rotary_embedding(a["positions"], a["query"], a["key"], D, a["cos_sin_cache"], True)
    if impl == "unfused":
        def unfused(a):
            rope.vllm.rotary_embedding(a["positions"], a["query"], a["key"], D, a["cos_sin_cache"], True)
            index_write(a, a["key"])
        return unfused
    try:
        rot = liger_rope()
    except ImportError as e:
        pytest.skip(f"liger_kernel not importable ({e}); pip install liger-kernel")

    def liger(a):
        _, k = rot(a)
        index_write(a, k)
    return liger


def liger_k_cache(a):
    """The k cache Liger's path should write, in float64: k rotated by the bf16 tables Liger is given (rounding
    the fp32 cos/sin to bf16 moves k by up to 2^-9 of its head's scale, which is Liger's input, not its error)."""
    rows = a["cos_sin_cache"][a["positions"]]
    cos, sin = (torch.cat([h, h], -1).to(torch.bfloat16).double()[:, None] for h in rows.chunk(2, -1))
    k = a["key"].view(-1, HK, D).double()
    want = k * cos + torch.cat([-k[..., D // 2:], k[..., : D // 2]], -1) * sin
    if a["key_cache"].dtype == FP8:  # the cache holds x / scale, saturated
        want = (want / a["k_scale"].double()).clamp(-448.0, 448.0)
    out = a["key_cache"].double().view(-1, HK, D).clone()
    out[a["slot_mapping"]] = want
    return out.view(a["key_cache"].shape)


def check(impl, fn, tokens, cache):
    """The implementation's caches against the fused op's on the same inputs (Liger's k: against float64 from
    the tables it is given)."""
    if impl == "rope_alone":
        return
    want, got = inputs(tokens, cache), inputs(tokens, cache)
    liger_want = liger_k_cache(got) if impl == "liger" else None
    rope.serving.rope_and_cache(**want)
    fn(got)
    for n in ("key_cache", "value_cache"):
        w, g = want[n].view(torch.uint8), got[n].view(torch.uint8)
        if n == "value_cache":
            assert torch.equal(w, g), f"{impl}: {n} differs from the fused op's"
        else:  # each kernel rounds its own rotation (FMA contraction differs by kernel): within 2 roundings
            wf, gf = (want[n].double() if liger_want is None else liger_want), got[n].double()
            tol = (2.0**-2 if cache == "fp8" else 2.0**-7) * wf.abs().amax(-1, keepdim=True)  # of the head's largest
            assert ((wf - gf).abs() <= tol).all(), f"{impl}: {n} beyond two roundings of the expected"


@pytest.mark.parametrize("shape,cache,impl", CASES, ids=["-".join(c) for c in CASES])
def test_serving(benchmark, shape, cache, impl):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import bench_rope  # its module skips without a GPU: imported here, after the check

    tokens = SHAPES[shape]
    fn = path(impl)
    try:
        check(impl, fn, tokens, cache)
    except AssertionError as e:  # rope's paths must agree; a peer that does not is reported, not timed
        if impl != "liger":
            raise
        pytest.skip(f"liger disagrees with the fused op, not timed: {e}")
    a = inputs(tokens, cache)
    benchmark.pedantic(lambda: fn(a), rounds=20, iterations=5, warmup_rounds=2)
    try:
        us = bench_rope.gpu_us(lambda: [lambda: fn(a)], 20)
    except RuntimeError as e:  # a path that cannot be captured: eager times only
        benchmark.extra_info["graph_error"] = str(e).splitlines()[0][:200]
        return
    benchmark.extra_info.update(gpu_us=us, tokens=tokens, cache=cache)
