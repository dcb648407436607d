"""pytest-benchmark: QK-RMSNorm + RoPE fused (`rope.qknorm.apply`) against the unfused paths users run today.

    pytest benchmarks/bench_qknorm.py --benchmark-only --benchmark-json=$OUT/qknorm.json

Cases: Qwen3-8B (q 32 / kv 8 heads) and Qwen3-30B-A3B (q 32 / kv 4), d 128, bf16; prefill of 4096 and 16384 tokens
(b = 1) and decode of 64 sequences (b = 64, s = 1); q and k as the projection gives them, [b, s, h, d]. Modes: fwd
(no grad) and fwd+bwd (forward, then the backward of random upstream gradients to q, k and both weights).
Implementations: `fused`; `torch` (torch.nn.functional.rms_norm in float32, then rope.hf); `hf` (Qwen3's eager
expressions: Qwen3RMSNorm, then apply_rotary_pos_emb with rotate_half, as transformers writes them) and
`hf_compiled` (the same under torch.compile); `liger` (Liger's RMSNorm kernel and Liger's RoPE, where
`pip install liger-kernel` put them). Each is first checked against float64 (within 4 bf16 roundings), then timed
eagerly (pytest-benchmark) and as CUDA-graph replays (extra_info gpu_us: median per call; graph_gbps: bytes of q
and k read and written over it). Without a GPU every case is collected and skipped.
"""
from __future__ import annotations

import importlib
import statistics

import pytest
import torch

import rope
import rope.qknorm

EPS = 1e-6
MODELS = {"qwen3-8b": (32, 8), "qwen3-30b-a3b": (32, 4)}
SHAPES = {"prefill4k": (1, 4096), "prefill16k": (1, 16384), "decode64": (64, 1)}
IMPLS = ("fused", "torch", "hf", "hf_compiled", "liger")
MODES = ("fwd", "fwd+bwd")
CASES = [(m, s, i, mode) for m in MODELS for s in SHAPES for i in IMPLS for mode in MODES]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rms_norm(x, w, eps):
    """Qwen3RMSNorm's forward: float32 variance, rounded back to x's dtype, times the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def hf_path(q, k, wq, wk, cos, sin):
    """Qwen3Attention: norm on [b, s, h, d], transpose, apply_rotary_pos_emb (unsqueeze_dim=1)."""
    q, k = hf_rms_norm(q, wq, EPS).transpose(1, 2), hf_rms_norm(k, wk, EPS).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def torch_path(q, k, wq, wk, cos, sin):
    rms = torch.nn.functional.rms_norm
    qn = rms(q.float(), (q.shape[-1],), wq.float(), EPS).to(q.dtype)
    kn = rms(k.float(), (k.shape[-1],), wk.float(), EPS).to(k.dtype)
    return rope.hf.apply_rotary_pos_emb(qn, kn, cos, sin, unsqueeze_dim=2)


def fused_path(q, k, wq, wk, cos, sin):
    return rope.qknorm.apply(q, k, wq, wk, cos, sin, eps=EPS, unsqueeze_dim=2)


def liger_path():
    norm = importlib.import_module("liger_kernel.ops.rms_norm").LigerRMSNormFunction
    rot = importlib.import_module("liger_kernel.transformers.rope").liger_rotary_pos_emb

    def path(q, k, wq, wk, cos, sin):
        qn = norm.apply(q, wq, EPS, 0.0, "llama", False).transpose(1, 2)
        kn = norm.apply(k, wk, EPS, 0.0, "llama", False).transpose(1, 2)
        return rot(qn, kn, cos, sin)

    return path


def implementation(name):
    if name == "hf_compiled":
        return torch.compile(hf_path)
    if name == "liger":
        try:
            return liger_path()
        except ImportError as e:
            pytest.skip(f"liger_kernel not importable ({e}); pip install liger-kernel")
    return {"fused": fused_path, "torch": torch_path, "hf": hf_path}[name]


def inputs(model, shape):
    hq, hk = MODELS[model]
    b, s = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def r(*size, dtype=torch.bfloat16):
        return torch.randn(size, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    theta = torch.rand(b, s, 64, generator=gen, device="cuda") * 1000
    cos, sin = (torch.cat([f(theta)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    return r(b, s, hq, 128), r(b, s, hk, 128), 1 + 0.1 * r(128), 1 + 0.1 * r(128), cos, sin


def check(fn, args):
    """Both outputs within 4 bf16 roundings (2^-6 relative to the pair scale) of float64."""
    q, k, wq, wk, cos, sin = args
    outs = fn(*args)
    for x, w, y in ((q, wq, outs[0]), (k, wk, outs[1])):
        y = y if y.shape == x.shape else y.transpose(1, 2)
        xd = x.double()
        a = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS) * w.double()
        c, s = cos.double().unsqueeze(2), sin.double().unsqueeze(2)
        want = a * c + rotate_half(a) * s
        scale = a.abs() + rotate_half(a).abs()
        assert ((y.double() - want).abs() <= 2.0**-6 * scale + 1e-6).all(), "result outside 4 bf16 roundings"


def calls(fn, args, mode):
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn(*args)
        return run
    leaves = [t.detach().clone().requires_grad_() for t in args[:4]]
    ups = [torch.randn_like(t) for t in args[:2]]

    def run():
        qo, ko = fn(*leaves, *args[4:])
        qo, ko = (qo, ko) if qo.shape == args[0].shape else (qo.transpose(1, 2), ko.transpose(1, 2))
        torch.autograd.backward([qo, ko], ups)
    return run


def graph_us(run, n=20, replays=20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(n):
                run()
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    torch.cuda.current_stream().wait_stream(stream)
    return statistics.median(times) * 1e3 / n


@pytest.mark.parametrize("model,shape,impl,mode", CASES, ids=["-".join(c) for c in CASES])
def test_qknorm(benchmark, model, shape, impl, mode):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = inputs(model, shape)
    fn = implementation(impl)
    check(fn, args)
    run = calls(fn, args, mode)
    benchmark.pedantic(run, rounds=20, iterations=5, warmup_rounds=2)
    try:
        us = graph_us(run)
    except RuntimeError as e:  # a path that cannot be captured: eager times only
        benchmark.extra_info["graph_error"] = str(e).splitlines()[0][:200]
        return
    qk_bytes = 2 * (args[0].nbytes + args[1].nbytes)
    benchmark.extra_info.update(gpu_us=us, graph_gbps=qk_bytes / (us * 1e-6) / 1e9)
