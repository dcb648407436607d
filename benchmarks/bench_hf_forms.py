"""transformers' partial rotary: rope.hf against transformers' eager function (slice, rotate_half, cat) and its
torch.compile'd form, at two models' shapes, q and k together and q alone (the one-tensor form), bf16.

    qwen3-next  head_dim 256, rotary 64 (partial_rotary_factor 0.25), 16 q heads, 2 kv heads
    phi4-mini   head_dim 96, rotary 72 (partial_rotary_factor 0.75), 24 q heads, 8 kv heads
q and k lie as transformers' attention makes them: a [b, s, h, d] projection viewed as [b, h, s, d]; cos and sin
[1, s, r] in bf16, as the models' rotary modules return them. transformers' function is imported where installed
(Qwen3-Next's, Phi-3's: the same expression); elsewhere the expression written here stands for it, named so in the
benchmark's extra_info. Each implementation first agrees with rope's result within bf16 rounding.

    pytest --benchmark-only benchmarks/bench_hf_forms.py --benchmark-json=$OUT/hf_forms.json
Without a GPU every case skips (collection works anywhere).
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

import pytest
import torch
from timing import cuda_sync_clock

import rope

if torch.cuda.is_available():
    from bench_rope import gpu_us


pytestmark = pytest.mark.benchmark(timer=cuda_sync_clock, disable_gc=True, min_time=0.003, max_time=0.2, min_rounds=5,
                                   warmup=True, warmup_iterations=3)


class Shape(NamedTuple):
    name: str
    b: int
    s: int
    hq: int
    hk: int
    d: int
    rot: int
    peer: str  # transformers' function for this model


SHAPES = (Shape("qwen3-next", 2, 4096, 16, 2, 256, 64,
                "transformers.models.qwen3_next.modeling_qwen3_next:apply_rotary_pos_emb"),
          Shape("phi4-mini", 2, 4096, 24, 8, 96, 72, "transformers.models.phi3.modeling_phi3:apply_rotary_pos_emb"))
IMPLS = ("clone", "rope", "eager", "compile")
FORMS = ("qk", "q")
MODES = ("fwd", "fwd+bwd")
PARAMS = [(shape, form, impl, mode) for shape in SHAPES for form in FORMS for impl in IMPLS for mode in MODES]


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def eager_pair(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' partial-rotary expression (GPT-NeoX, Phi, Qwen3-Next): slice, rotate_half, cat."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    q_rot, q_pass, k_rot, k_pass = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    q_embed = torch.cat([q_rot * cos + _rotate_half(q_rot) * sin, q_pass], dim=-1)
    k_embed = torch.cat([k_rot * cos + _rotate_half(k_rot) * sin, k_pass], dim=-1)
    return q_embed, k_embed


def eager_single(x, cos, sin, unsqueeze_dim=1):
    """The same expression on one tensor."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    return torch.cat([x[..., :r] * cos + _rotate_half(x[..., :r]) * sin, x[..., r:]], dim=-1)


def _peer_pair(shape):
    """transformers' own function where installed, else the expression above: (callable, its name)."""
    module, attr = shape.peer.split(":")
    try:
        return getattr(importlib.import_module(module), attr), shape.peer
    except Exception:  # transformers not installed, or without this model
        return eager_pair, "benchmarks/bench_hf_forms.py:eager_pair"


def _inputs(shape, form):
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s, d = shape.b, shape.s, shape.d

    def heads(h):  # a projection's [b, s, h, d] as [b, h, s, d]
        return torch.randn(b, s, h, d, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)

    inv = 1.0 / (1e6 ** (torch.arange(0, shape.rot, 2, device="cuda", dtype=torch.float32) / shape.rot))
    ang = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * inv
    ang = torch.cat([ang, ang], dim=-1)[None]
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    xs = [heads(shape.hq)] + ([heads(shape.hk)] if form == "qk" else [])
    return xs, cos, sin


def _clone(*args):
    """The floor: a copy of each rotated tensor (the bytes every implementation reads and writes)."""
    return [x.clone() for x in args[:-2]]


def _function(shape, form, impl):
    if impl == "clone":
        return _clone, "clone"
    if impl == "rope":
        fn = rope.hf.apply_rotary_pos_emb if form == "qk" else rope.hf.apply_rotary_pos_emb_single
        return fn, "rope.hf"
    fn, name = _peer_pair(shape) if form == "qk" else (eager_single, "benchmarks/bench_hf_forms.py:eager_single")
    if impl == "compile":
        return torch.compile(fn), f"torch.compile({name})"
    return fn, name


@pytest.mark.parametrize(("shape", "form", "impl", "mode"), PARAMS,
                         ids=[f"{s.name}-{f}-{i}-{m}" for s, f, i, m in PARAMS])
def test_hf_partial(benchmark, shape, form, impl, mode):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: on a CPU only Triton's interpreter would be timed")
    xs, cos, sin = _inputs(shape, form)
    fn, name = _function(shape, form, impl)
    benchmark.group = f"{shape.name} {form} {mode}: d {shape.d}, rotary {shape.rot}, heads {shape.hq}/{shape.hk}"
    benchmark.extra_info.update(impl=name, shape=shape._asdict())

    def call(*ts):
        out = fn(*ts, cos, sin)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    # Agreement first, with rope's result (float32 math, one bf16 rounding: within 2^-9 |ref| of the value from the
    # inputs as given). transformers' expression evaluates in bf16: two products and a sum, each rounded within 2^-9
    # of a value at most S = |x_i| + |x_partner|, so within 3 2^-9 S < 2^-7 S; the pass-through channels are copies.
    with torch.no_grad():
        ref = _function(shape, form, "rope" if impl != "clone" else "clone")[0](*xs, cos, sin)
        want = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        for x, got, ref in zip(xs, call(*xs), want, strict=True):
            head = x[..., :shape.rot].float().abs()
            partner = torch.cat([head[..., shape.rot // 2:], head[..., :shape.rot // 2]], dim=-1)
            scale = torch.cat([head + partner, torch.zeros_like(x[..., shape.rot:], dtype=torch.float32)], dim=-1)
            err = (got.float() - ref.float()).abs()
            bad = err > 2**-7 * scale + 2**-8 * ref.float().abs()
            assert not bad.any(), f"{name}: {int(bad.sum())} elements beyond bf16 rounding of rope's result"
    if mode == "fwd":
        def target():
            with torch.no_grad():
                call(*xs)
    else:
        leaves = [x.detach().requires_grad_() for x in xs]
        ups = [torch.randn_like(o) for o in call(*leaves)]

        def target():
            outs = call(*leaves)
            torch.autograd.backward(outs, ups)
    # the GPU's time per call, replayed in a CUDA graph (bench_rope.gpu_us), beside pytest-benchmark's eager time
    benchmark.extra_info["gpu_us"] = gpu_us(lambda: [target], 16) if impl != "compile" or mode == "fwd" else None
    benchmark.extra_info["bytes"] = sum(2 * x.numel() * x.element_size() for x in xs)
    benchmark(target)
