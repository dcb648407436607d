"""The copy-limit and latency targets on one card, in one process: each case as users lay its inputs out, measured
in CUDA graphs and eager, against what the target compares it with, and the verdict.

    python benchmarks/targets.py

Bandwidth targets compare rope with `clone` of the tensors it reads (the same bytes read and written) in the same
run: ratio = clone's time / rope's. Latency targets compare times: rope's transformers-layout decode with Liger's
(where Liger is installed), and the fused KV-cache write with rope alone. Graph: 50 calls per graph, best of three;
eager: the median of five rounds of 300 calls to the end of the GPU's work (timing.py). Every rope output is first
checked against float64 (one bf16 rounding of float32 math, beyond which a value is wrong).
"""
import importlib
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import eager_us, graph_us  # noqa: E402

import rope  # noqa: E402

DEV, BF = "cuda", torch.bfloat16


def both(fn):
    """(graph µs, eager µs) of fn."""
    return (min(graph_us(fn) for _ in range(3)), statistics.median(eager_us(fn)[0] for _ in range(5)))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def check(got, want, what):
    """got within one bf16 rounding (2**-8 of each head's largest value) of float64 `want`."""
    for g, w in zip(got, want, strict=True):
        bound = 2.0**-8 * w.abs().amax(-1, keepdim=True) + 1e-30
        assert ((g.double() - w).abs() <= bound).all(), f"{what}: beyond one rounding of float64"


def hf_inputs(b, s, hq=32, hk=8, d=128):
    q = torch.randn(b, s, hq, d, device=DEV, dtype=BF).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=DEV, dtype=BF).transpose(1, 2)
    ang = torch.rand(b, s, d // 2, device=DEV) * 100
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(BF) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


def hf_want(q, k, cos, sin):
    c, s = cos.double()[:, None], sin.double()[:, None]
    return [x.double() * c + rotate_half(x.double()) * s for x in (q, k)]


def bandwidth_cases():
    """(name, rope call, clone of the bytes it reads, check) for the large shapes of each convention's layout."""
    out = []
    q, k, cos, sin = hf_inputs(8, 4096)
    check(rope.hf.apply_rotary_pos_emb(q, k, cos, sin), hf_want(q, k, cos, sin), "transformers")
    out.append(("transformers [b, h, s, d] views, [b, s, d] bf16 tables, b 8 s 4K, 32/8 heads",
                lambda: rope.hf.apply_rotary_pos_emb(q, k, cos, sin), lambda: (q.clone(), k.clone())))
    t = torch.randn(4096, 8, 32, 128, device=DEV, dtype=BF)
    freqs = torch.rand(4096, 1, 1, 128, device=DEV) * 100
    want = t.double() * freqs.double().cos() + rotate_half(t.double()) * freqs.double().sin()
    check([rope.apply_rotary_pos_emb(t, freqs, "sbhd", fused=True)], [want], "TE sbhd")
    tb = t.transpose(0, 1).contiguous()
    cu = torch.arange(0, 8 * 4096 + 1, 4096, device=DEV, dtype=torch.int32)
    tt = tb.reshape(8 * 4096, 32, 128)
    out += [("TE sbhd 4K x 8 x 32 x 128", lambda: rope.apply_rotary_pos_emb(t, freqs, "sbhd", fused=True),
             lambda: t.clone()),
            ("TE bshd 8 x 4K x 32 x 128", lambda: rope.apply_rotary_pos_emb(tb, freqs, "bshd", fused=True),
             lambda: tb.clone()),
            ("TE thd 8 sequences of 4K, 32 x 128",
             lambda: rope.apply_rotary_pos_emb(tt, freqs, "thd", fused=True, cu_seqlens=cu), lambda: tt.clone())]
    T = 32768
    cache = torch.cat([f(torch.rand(T, 64, device=DEV) * 100) for f in (torch.cos, torch.sin)], -1)
    pos = torch.randint(0, T, (T,), device=DEV)
    vq, vk = torch.randn(T, 32 * 128, device=DEV, dtype=BF), torch.randn(T, 8 * 128, device=DEV, dtype=BF)
    out.append((f"vLLM [T, h*d], T {T // 1024}K, positions into an fp32 cache, in place",
                lambda: rope.vllm.rotary_embedding(pos, vq, vk, 128, cache, True), lambda: (vq.clone(), vk.clone())))
    for tokens in (4096, 16384):
        nq, nk, ncos, nsin = hf_inputs(1, tokens)
        wq, wk = (1 + 0.1 * torch.randn(128, device=DEV)).to(BF), (1 + 0.1 * torch.randn(128, device=DEV)).to(BF)
        out.append((f"QK-RMSNorm + RoPE forward, Qwen3-8B, {tokens // 1024}K tokens",
                    lambda nq=nq, nk=nk, wq=wq, wk=wk, c=ncos, s=nsin: rope.qknorm.apply(nq, nk, wq, wk, c, s),
                    lambda nq=nq, nk=nk: (nq.clone(), nk.clone())))
    return out


def latency_cases():
    """(name, rope call, the call it is compared with, allowed excess in µs)."""
    out = []
    q, k, cos, sin = hf_inputs(64, 1)
    try:
        liger = importlib.import_module("liger_kernel.transformers.rope").liger_rotary_pos_emb
        lq, lk = q.clone(), k.clone()
        out.append(("transformers decode 64, q+k, against Liger (in place)",
                    lambda: rope.hf.apply_rotary_pos_emb(q, k, cos, sin), lambda: liger(lq, lk, cos, sin), 0.0))
    except ImportError as e:
        print(f"Liger not importable ({e}): its decode target is not measured")
    serving = importlib.import_module("bench_serving")
    for tokens in (64, 256):
        for cache in ("auto", "fp8"):
            a = serving.inputs(tokens, cache)
            out.append((f"RoPE + KV-cache write, decode {tokens}, {'bf16' if cache == 'auto' else 'fp8'} cache, "
                        "against rope alone", lambda a=a: rope.serving.rope_and_cache(**a),
                        lambda a=a: rope.vllm.rotary_embedding(a["positions"], a["query"], a["key"], 128,
                                                               a["cos_sin_cache"], True),
                        0.3 if cache == "auto" else 0.5))
    return out


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__)
    print("\n| case | rope graph / eager (µs) | clone graph / eager | clone / rope graph / eager | ≥ 0.95 (0.92 for "
          "QK-norm) |\n|---|---|---|---|---|")
    for name, fn, copy in bandwidth_cases():
        (rg, re_), (cg, ce) = both(fn), both(copy)
        goal = 0.92 if "QK" in name else 0.95
        verdict = "met" if min(cg / rg, ce / re_) >= goal else "missed"
        print(f"| {name} | {rg:.2f} / {re_:.2f} | {cg:.2f} / {ce:.2f} | {cg / rg:.3f} / {ce / re_:.3f} | {verdict} |",
              flush=True)
    print("\n| case | rope graph (µs) | compared graph | excess | allowed | verdict |\n|---|---|---|---|---|---|")
    for name, fn, other, allowed in latency_cases():
        r, o = min(graph_us(fn) for _ in range(3)), min(graph_us(other) for _ in range(3))
        print(f"| {name} | {r:.2f} | {o:.2f} | {r - o:+.2f} | {allowed:+.1f} | "
              f"{'met' if r - o <= allowed else 'missed'} |", flush=True)


if __name__ == "__main__":
    main()
