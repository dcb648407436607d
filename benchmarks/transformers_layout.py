"""transformers' attention layer as it calls RoPE: q and k as [b, h, s, d] views of the [b, s, h, d] projection,
cos/sin [b, s, d] in the model's dtype (one row per sequence, as the rotary module returns them); 32 q / 8 kv heads,
d 128, bf16. rope's `rope.hf.apply_rotary_pos_emb` against Liger-Kernel's `liger_rotary_pos_emb` (in place: it
rotates the same tensors on every call, which changes their values, not the work) and `clone` of q and k, in one
process. Graph replay (50 calls per graph, best of three) and eager calls (median of seven rounds of 300 calls, the
wall time to the end of the GPU's work). rope's output is checked against float64 first (within two bf16 roundings
of each value's magnitude), Liger's against rope's (Liger computes in bf16).

    python benchmarks/transformers_layout.py
"""
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from timing import eager_us, graph_us  # noqa: E402

import rope  # noqa: E402

DEV = "cuda"
# (name, b, s, q and k contiguous [b, h, s, d] instead of views)
CASES = (("prefill b 8, s 4096", 8, 4096, False), ("prefill b 8, s 4096, contiguous [b, h, s, d]", 8, 4096, True),
         ("prefill b 1, s 4096", 1, 4096, False), ("decode b 64", 64, 1, False))


def inputs(b, s, contiguous, dtype=torch.bfloat16):
    q = torch.randn(b, s, 32, 128, device=DEV, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, 8, 128, device=DEV, dtype=dtype).transpose(1, 2)
    if contiguous:
        q, k = q.contiguous(), k.contiguous()
    angles = torch.rand(b, s, 64, device=DEV) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


def float64_rotation(x, cos, sin):
    x, c, s = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    h = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., h:], x[..., :h]), -1) * s


def liger():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return liger_rotary_pos_emb


def times(fn):
    graph = min(graph_us(fn) for _ in range(3))
    eager = statistics.median(eager_us(fn)[0] for _ in range(7))
    return graph, eager


def main():
    print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__)
    liger_fn = liger()
    print("| case | rope, graph / eager | Liger (in place), graph / eager | clone of q and k, graph / eager | "
          "rope / clone (graph) |")
    print("|---|---|---|---|---|")
    for name, b, s, contiguous in CASES:
        q, k, cos, sin = inputs(b, s, contiguous)
        got = rope.hf.apply_rotary_pos_emb(q, k, cos, sin)
        for x, y in zip((q, k), got, strict=True):
            want = float64_rotation(x, cos, sin)
            bound = 2 * 2.0**-8 * want.abs().amax(-1, keepdim=True) + 1e-30
            assert ((y.double() - want).abs() <= bound).all(), f"{name}: rope differs from float64"
        ours = times(lambda: rope.hf.apply_rotary_pos_emb(q, k, cos, sin))  # noqa: B023
        copy = times(lambda: (q.clone(), k.clone()))  # noqa: B023
        theirs = "not installed"
        if liger_fn is not None:
            ql, kl = q.clone(), k.clone()
            lq, lk = liger_fn(ql, kl, cos, sin)
            for y, r in zip((lq, lk), got, strict=True):
                assert (y.double() - r.double()).abs().max() < 0.1, f"{name}: Liger differs from rope"
            lg = times(lambda: liger_fn(ql, kl, cos, sin))  # noqa: B023
            theirs = f"{lg[0]:.2f} / {lg[1]:.2f}"
        print(f"| {name} | {ours[0]:.2f} / {ours[1]:.2f} | {theirs} | {copy[0]:.2f} / {copy[1]:.2f} | "
              f"{copy[0] / ours[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
