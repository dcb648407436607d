"""rope's schedules (`schedule="eager"` and `"float32"`) against its default, in one process, alternating: CUDA-graph
replay (50 calls per graph, best of three rounds) and eager calls (median of seven rounds of 300 calls, the wall time
to the end of the GPU's work). Before timing, each case's eager-schedule output is checked bitwise against the
PyTorch expression it names (transformers' `apply_rotary_pos_emb`, vLLM's `forward_native`, Qwen3's RMSNorm of
q and k then `apply_rotary_pos_emb`).

    python benchmarks/schedules.py
"""
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from timing import eager_us, graph_us  # noqa: E402

import rope  # noqa: E402

DEV = "cuda"
SCHEDULES = (None, "eager", "float32")


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def transformers_expression(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def forward_native(positions, query, key, head_size, cache):
    cos, sin = cache.index_select(0, positions).chunk(2, -1)
    out = []
    for x in (query, key):
        heads = x.view(positions.numel(), -1, head_size)
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = heads.chunk(2, -1)
        out.append(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).reshape(x.shape))
    return out


def transformers_cases():
    """q and k as [b, h, s, d] views of the [b, s, h, d] projection, cos/sin [b, s, d] in the model's dtype."""
    for b, s, name in ((8, 4096, "transformers prefill 8 x 4K"), (1, 4096, "transformers prefill 1 x 4K"),
                       (64, 1, "transformers decode 64")):
        for dtype in (torch.bfloat16, torch.float16, torch.float32) if b == 1 else (torch.bfloat16,):
            q = torch.randn(b, s, 32, 128, device=DEV, dtype=dtype).transpose(1, 2)
            k = torch.randn(b, s, 8, 128, device=DEV, dtype=dtype).transpose(1, 2)
            angles = torch.rand(b, s, 64, device=DEV) * 100
            cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
            calls = {sch: (lambda q=q, k=k, cos=cos, sin=sin, sch=sch:
                           rope.hf.apply_rotary_pos_emb(q, k, cos, sin, schedule=sch)) for sch in SCHEDULES}
            got = calls["eager"]()
            same = all(torch.equal(g, w) for g, w in zip(got, transformers_expression(q, k, cos, sin), strict=True))
            yield f"{name} {str(dtype)[6:]}", calls, same


def vllm_cases():
    """query and key [T, h * d] bf16, rotated in place at positions of a float32 cos_sin_cache."""
    cache = torch.randn(8192, 128, device=DEV)
    for tokens, name in ((4096, "vLLM prefill 4K"), (64, "vLLM decode 64")):
        positions = torch.randint(0, 8192, (tokens,), device=DEV)
        query = torch.randn(tokens, 32 * 128, device=DEV, dtype=torch.bfloat16)
        key = torch.randn(tokens, 8 * 128, device=DEV, dtype=torch.bfloat16)
        want = forward_native(positions, query, key, 128, cache)
        q, k = query.clone(), key.clone()
        rope.vllm.rotary_embedding(positions, q, k, 128, cache, True, schedule="eager")
        same = torch.equal(q, want[0]) and torch.equal(k, want[1])
        # timed in place on the same buffers, as a serving step rotates each new batch
        calls = {sch: (lambda sch=sch, p=positions, q=q, k=k:
                       rope.vllm.rotary_embedding(p, q, k, 128, cache, True, schedule=sch)) for sch in SCHEDULES}
        yield name, calls, same


def qwen3_expression(q, k, wq, wk, cos, sin, eps=1e-6):
    """Qwen3's attention from its projections: q_norm and k_norm (Qwen3RMSNorm) on the [b, s, h, d] views, the
    transpose, then apply_rotary_pos_emb."""
    def norm(x, w):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)
    return transformers_expression(norm(q, wq).transpose(1, 2), norm(k, wk).transpose(1, 2), cos, sin)


def qknorm_cases():
    """Qwen3-8B's QK norm and rotation (32 q and 8 k heads of 128, bf16), q and k the [b, s, h, d] projections."""
    for b, s, name in ((1, 4096, "QK norm prefill 1 x 4K"), (64, 1, "QK norm decode 64")):
        q = torch.randn(b, s, 32, 128, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(b, s, 8, 128, device=DEV, dtype=torch.bfloat16)
        wq, wk = (torch.rand(128, device=DEV, dtype=torch.bfloat16) + 0.5 for _ in range(2))
        angles = torch.rand(b, s, 64, device=DEV) * 100
        cos, sin = (f(torch.cat([angles, angles], -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        calls = {sch: (lambda sch=sch, q=q, k=k, wq=wq, wk=wk, cos=cos, sin=sin:
                       rope.qknorm.apply(q, k, wq, wk, cos, sin, unsqueeze_dim=2, schedule=sch))
                 for sch in (None, "eager")}
        got = [x.transpose(1, 2) for x in calls["eager"]()]
        same = all(torch.equal(g, w) for g, w in zip(got, qwen3_expression(q, k, wq, wk, cos, sin), strict=True))
        yield name, calls, same


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", __import__("triton").__version__)
    for name, calls, same in (*transformers_cases(), *vllm_cases(), *qknorm_cases()):
        graph = {s: [] for s in calls}
        eager = {s: [] for s in calls}
        for _ in range(3):
            for s, fn in calls.items():
                graph[s].append(graph_us(fn))
        for _ in range(7):
            for s, fn in calls.items():
                eager[s].append(eager_us(fn)[0])
        g = {s: min(v) for s, v in graph.items()}
        e = {s: statistics.median(v) for s, v in eager.items()}
        others = [s for s in calls if s is not None]
        print(f"{name:32s} graph: default {g[None]:7.2f} µs, "
              + ", ".join(f"{s} {g[s]:7.2f} ({g[s] / g[None]:.3f}x)" for s in others)
              + f" | eager calls: default {e[None]:7.2f}, " + ", ".join(f"{s} {e[s]:7.2f}" for s in others)
              + f" | eager schedule bitwise the expression: {same}", flush=True)


if __name__ == "__main__":
    main()
