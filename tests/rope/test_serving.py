"""rope.serving beyond the native suite (tests/conformance, conventions vllm-cache and sglang-cache): bad input refused
before anything is written, with the argument's name first; uint8 fp8 caches; the kernel against the reference
path; torch.compile; on a GPU, CUDA-graph capture following positions, slots and scales changed in place, and fp8
bitwise against vLLM's conversion."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import rope.serving as sv
import rope.vllm

from .cases import DEVICE, ON_GPU, gpu_only

FP8 = torch.float8_e4m3fn


def _vllm(t=5, hq=4, hk=2, d=10, rot=8, nb=3, bs=4, dtype=torch.float32, fp8=False, seed=0, n_slots=None):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, dt=dtype):
        return torch.randn(shape, generator=gen).to(dt).to(DEVICE)

    theta = torch.rand(16, rot // 2, generator=gen) * 20
    slots = torch.randperm(nb * bs, generator=gen)[:t if n_slots is None else n_slots]
    slots[1] = -1
    return dict(positions=torch.randint(0, 16, (t,), generator=gen).to(DEVICE), query=r(t, hq * d),
                key=r(t, hk * d), value=r(t, hk, d), key_cache=r(nb, bs, hk, d, dt=FP8 if fp8 else dtype),
                value_cache=r(nb, bs, hk, d, dt=FP8 if fp8 else dtype), slot_mapping=slots.to(DEVICE),
                cos_sin_cache=torch.cat([theta.cos(), theta.sin()], -1).to(DEVICE), is_neox=True,
                kv_cache_dtype="fp8" if fp8 else "auto",
                k_scale=torch.tensor([0.5], device=DEVICE) if fp8 else None,
                v_scale=torch.tensor([0.25], device=DEVICE) if fp8 else None)


def _sglang(t=5, hq=4, hk=2, d=10, pool=9, seed=1):
    a = _vllm(t=t, hq=hq, hk=hk, d=d, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return dict(q=a["query"].view(t, hq, d), k=a["key"].view(t, hk, d), v=a["value"],
                k_cache=torch.randn(pool, hk * d, generator=gen).to(DEVICE),
                v_cache=torch.randn(pool, hk, d, generator=gen).to(DEVICE), cos_sin_cache=a["cos_sin_cache"],
                positions=a["positions"], out_loc=torch.randperm(pool, generator=gen)[:t].to(DEVICE), is_neox=False)


def _bits(args):
    return {n: v.detach().cpu().clone().view(torch.uint8) for n, v in args.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}


BAD_VLLM = [
    ("slot_mapping", ValueError, lambda a: a["slot_mapping"].__setitem__(0, 12)),  # 3 * 4 slots
    ("slot_mapping", ValueError, lambda a: a["slot_mapping"].__setitem__(0, -2)),
    ("slot_mapping", ValueError, lambda a: a.update(slot_mapping=torch.arange(6, device=DEVICE))),
    ("slot_mapping", TypeError, lambda a: a.update(slot_mapping=a["slot_mapping"].float())),
    ("positions", ValueError, lambda a: a["positions"].__setitem__(2, 16)),
    ("key_cache", ValueError, lambda a: a.update(key_cache=a["key_cache"][0])),
    ("key", ValueError, lambda a: a.update(key_cache=a["key_cache"][:, :, :1])),  # the caches hold hk heads
    ("key_cache", TypeError, lambda a: a.update(key_cache=a["key_cache"].half())),
    ("value_cache", ValueError, lambda a: a.update(value_cache=a["value_cache"][:2])),
    ("value_cache", TypeError, lambda a: a.update(value_cache=a["value_cache"].to(FP8))),
    ("key", ValueError, lambda a: a.update(key=a["key"][:, :10])),
    ("value", ValueError, lambda a: a.update(value=a["value"][:, :1])),
    ("query", ValueError, lambda a: a.update(query=a["query"][:, :15])),
    ("query", TypeError, lambda a: a.update(query=a["query"].double())),
    ("key", ValueError, lambda a: a.update(key=a["key"].half())),
    ("kv_cache_dtype", ValueError, lambda a: a.update(kv_cache_dtype="fp8_e5m2")),
    ("is_neox", TypeError, lambda a: a.update(is_neox=1)),
    ("cos_sin_cache", ValueError, lambda a: a.update(cos_sin_cache=torch.zeros(16, 12, device=DEVICE))),
    ("key_cache", TypeError, lambda a: a.update(kv_cache_dtype="fp8")),  # float32 caches
]


@pytest.mark.parametrize("name,error,change", BAD_VLLM, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_VLLM)])
def test_vllm_bad_input_refused_before_writing(name, error, change):
    args = _vllm()
    change(args)
    before = _bits(args)
    with pytest.raises(error, match=f"^{name}"):
        sv.rope_and_cache(**args)
    for n, b in _bits(args).items():
        assert torch.equal(b, before[n]), f"{n} was written before the error"


def test_fp8_needs_scales():
    args = _vllm(fp8=True)
    args["v_scale"] = None
    with pytest.raises(TypeError, match="^v_scale"):
        sv.rope_and_cache(**args)
    args["v_scale"] = torch.tensor([1.0, 2.0], device=DEVICE)
    with pytest.raises(ValueError, match="^v_scale"):
        sv.rope_and_cache(**args)


BAD_SGLANG = [
    ("out_loc", ValueError, lambda a: a.update(out_loc=a["out_loc"][:4])),
    ("out_loc", ValueError, lambda a: a["out_loc"].__setitem__(0, -1)),
    ("out_loc", ValueError, lambda a: a["out_loc"].__setitem__(0, 9)),
    ("k_cache", ValueError, lambda a: a.update(k_cache=a["k_cache"][:, :10])),
    ("v_cache", ValueError, lambda a: a.update(v_cache=a["v_cache"][:8])),
    ("v_cache", TypeError, lambda a: a.update(v_cache=a["v_cache"].half())),
    ("v", ValueError, lambda a: a.update(v=a["v"][:, :1])),
    ("rope_dim", ValueError, lambda a: a.update(rope_dim=4)),
    ("q", TypeError, lambda a: a.update(q=a["q"].double())),
]


@pytest.mark.parametrize("name,error,change", BAD_SGLANG, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_SGLANG)])
def test_sglang_bad_input_refused_before_writing(name, error, change):
    args = _sglang()
    change(args)
    before = _bits(args)
    with pytest.raises(error, match=f"^{name}"):
        sv.apply_rope_inplace_with_kvcache(**args)
    for n, b in _bits(args).items():
        assert torch.equal(b, before[n]), f"{n} was written before the error"


def _unfused(a, as_uint8=False):
    """rope.vllm.rotary_embedding, then the index write in PyTorch (vLLM's fp8 conversion: x / scale in float32,
    saturated)."""
    q, k = a["query"].clone(), a["key"].clone()
    rope.vllm.rotary_embedding(a["positions"], q, k, 10, a["cos_sin_cache"], a["is_neox"])
    kc, vc = a["key_cache"].clone(), a["value_cache"].clone()
    slot = a["slot_mapping"].long()
    keep = slot >= 0
    for cache, x, scale in ((kc, k.view(k.shape[0], -1, 10), a["k_scale"]), (vc, a["value"], a["v_scale"])):
        x = x[:slot.shape[0]][keep]
        if scale is not None:
            x = (x.float() / scale).clamp(-448, 448)
        cache.view(-1, *cache.shape[2:])[slot[keep]] = x.to(cache.dtype)
    return q, k, kc, vc


@pytest.mark.parametrize("fp8", [False, True], ids=["auto", "fp8"])
def test_equals_rope_then_index_write_bitwise(fp8):
    """The kernel (interpreter or GPU) against rope.vllm.rotary_embedding followed by the write: one rotation, the
    same roundings; a short slot_mapping with a -1."""
    args = _vllm(fp8=fp8, dtype=torch.bfloat16, n_slots=4)
    want = _unfused(args)
    sv.rope_and_cache(**args)
    for got, w in zip((args["query"], args["key"], args["key_cache"], args["value_cache"]), want, strict=True):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))


def _every_bf16_stored(scale):
    """Every bf16 value but NaN (the 65536 patterns: zeros of both signs, subnormals, infinities) as v, stored by
    the fused op into an fp8 value cache at `scale`: (the cache's bytes, vLLM's e4m3(v / scale), the quotient in
    float32 rounded once, saturated)."""
    v = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v).reshape(128, 4, 128)
    t, hk, d = v.shape
    gen = torch.Generator().manual_seed(21)
    args = dict(positions=torch.zeros(t, dtype=torch.int64), query=torch.randn(t, d, generator=gen).bfloat16(),
                key=torch.randn(t, hk * d, generator=gen).bfloat16(), value=v,
                key_cache=torch.zeros(8, 16, hk, d, dtype=FP8), value_cache=torch.zeros(8, 16, hk, d, dtype=FP8),
                slot_mapping=torch.arange(t), cos_sin_cache=torch.randn(4, d, generator=gen), is_neox=True,
                kv_cache_dtype="fp8", k_scale=torch.tensor([scale]), v_scale=torch.tensor([scale]))
    args = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    sv.rope_and_cache(**args)
    want = (args["value"].float() / args["v_scale"]).clamp(-448, 448).to(FP8)
    return args["value_cache"].view(-1, hk, d)[:t].view(torch.uint8), want.view(torch.uint8)


# 0.0375: a scale where x * RN(1 / scale), unrounded further, gives another e4m3 byte than x / scale for 2 of the
# bf16 values; 0.004: quotients beyond float32's range for |x| > 1.4e36 (the interpreter warns of that overflow,
# which is the case under test).
OVERFLOW_EXPECTED = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")


@OVERFLOW_EXPECTED
@pytest.mark.parametrize("scale", [0.0375, 0.004])
def test_fp8_store_equals_the_division_for_every_bf16_value(scale):
    """The kernel divides by the scale without a division per element (`rope.kernels._common._to_cache`): its bytes
    equal vLLM's rounded quotient for every value."""
    got, want = _every_bf16_stored(scale)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} bytes differ"


@triton.jit
def _product_only(x, scale, inv):
    return x.to(tl.float32) * inv  # no correction step


@triton.jit
def _unguarded(x, scale, inv):
    xf = x.to(tl.float32)
    q0 = xf * inv
    return tl.fma(tl.fma(-q0, scale, xf), inv, q0)  # inf - inf where the product overflows; the sign of -0 lost


@OVERFLOW_EXPECTED
@pytest.mark.skipif(ON_GPU, reason="replaces a kernel helper, which only the interpreter resolves at each call")
@pytest.mark.parametrize("helper,scale", [(_product_only, 0.0375), (_unguarded, 0.004)], ids=["product", "unguarded"])
def test_fp8_division_check_catches_planted_roundings(monkeypatch, helper, scale):
    import rope.kernels._common

    monkeypatch.setattr(rope.kernels._common, "_quotient", helper)
    got, want = _every_bf16_stored(scale)
    assert not torch.equal(got, want)


def test_uint8_fp8_cache_is_read_as_e4m3():
    """vLLM allocates fp8 caches as uint8: the same bytes result as for float8_e4m3fn caches."""
    a, b = _vllm(fp8=True, seed=3), _vllm(fp8=True, seed=3)
    b["key_cache"], b["value_cache"] = b["key_cache"].view(torch.uint8), b["value_cache"].view(torch.uint8)
    sv.rope_and_cache(**a)
    sv.rope_and_cache(**b)
    assert torch.equal(a["key_cache"].view(torch.uint8), b["key_cache"])
    assert torch.equal(a["value_cache"].view(torch.uint8), b["value_cache"])


def test_compiled_matches_eager():
    """Under torch.compile each form is one opaque custom op (fullgraph, no break), writing what eager writes."""
    def step_vllm(a):
        sv.rope_and_cache(**a)
        return a["query"] * 2.0

    def step_sglang(a):
        sv.apply_rope_inplace_with_kvcache(**a)
        return a["q"] * 2.0

    torch._dynamo.reset()
    for make, step in ((_vllm, step_vllm), (_sglang, step_sglang)):
        eager, traced = make(), make()
        step(eager)
        torch.compile(step, backend="aot_eager", fullgraph=True)(traced)
        for n, v in eager.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(traced[n], v), n


@gpu_only
def test_graph_follows_positions_slots_and_scales():
    """Captured once, replayed after positions, slot_mapping and the fp8 scales change in place: each replay equals
    an eager call on the values of then."""
    a = _vllm(t=37, hq=8, hk=2, d=128, rot=128, nb=16, bs=16, dtype=torch.bfloat16, fp8=True, seed=5)
    q0, k0, kc0, vc0 = (a[n].clone() for n in ("query", "key", "key_cache", "value_cache"))

    def call():
        for n, v in (("query", q0), ("key", k0), ("key_cache", kc0), ("value_cache", vc0)):
            a[n].copy_(v)
        sv.rope_and_cache(**a)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        a["positions"].copy_(torch.randint(0, 16, (37,), generator=gen))
        slots = torch.randperm(256, generator=gen)[:37]
        slots[::5] = -1
        a["slot_mapping"].copy_(slots)
        a["k_scale"].fill_(float(torch.rand(1, generator=gen)) + 0.01)
        graph.replay()
        got = [a[n].clone() for n in ("query", "key", "key_cache", "value_cache")]
        call()
        for g, w in zip(got, (a[n] for n in ("query", "key", "key_cache", "value_cache")), strict=True):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
