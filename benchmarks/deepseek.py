"""DeepSeek's RoPE forms on the shapes the models pass, against transformers' own functions (eager and
`torch.compile`) and `clone` of the same bytes, in one process: CUDA-graph replay (50 calls per graph, best of three),
GPU µs per call.

- DeepSeek-V3 (`rope.hf.apply_rotary_pos_emb_interleave`): q_rot the 64 rope channels of 128 heads of 192, a
  [b, h, s, 64] view of the [b, s, h, 192] projection; k_rot the single shared head, a view of the [b, s, 576]
  compressed projection; cos/sin [b, s, 64] bf16. Prefill 4K and 16K, decode 64; forward, and forward + backward
  (`torch.autograd.grad` from random upstream gradients). `clone` copies q_rot and k_rot (the bytes the call reads
  and writes); "plain q+k" is `rope.hf.apply_rotary_pos_emb` on the same views, the decode target's reference.
- DeepSeek-V4 (`rope.deepseek.apply_rotary_pos_emb`): x [b, 128, s, 512] with the trailing 64 channels rotated,
  cos/sin [b, s, 32]; the result is a new tensor of x's shape, so `clone` of x is its byte count, and a one-pass
  Triton copy of x (its rows of 512 channels) the same bytes at a kernel's copy bandwidth.

Every rope output is first compared with transformers' function run in float64 on the same values (within two
roundings of bf16 of each row's largest value); where transformers lacks the model, the column says so.

    python benchmarks/deepseek.py [v3] [v4]       # both forms where none is named
"""
import importlib
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from timing import graph_us  # noqa: E402

import rope  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16


def peer(module, name):
    try:
        return getattr(importlib.import_module(f"transformers.models.{module}"), name)
    except (ImportError, AttributeError):
        return None


@triton.jit
def _rows_copy(x_ptr, out_ptr, n_rows, row_stride, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """A copy of WIDTH channels of each of n_rows rows, row_stride apart, into a dense [n_rows, WIDTH] tensor."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, WIDTH)[None, :]
    ok = r < n_rows
    tl.store(out_ptr + r * WIDTH + c, tl.load(x_ptr + r * row_stride + c, mask=ok), mask=ok)


def strided_copy(views, rows_per_program):
    """The bytes of each view whose rows lie in memory order (b, s, h), a fixed stride apart, copied in one pass
    to dense tensors: the floor for reading those rows where they are."""
    outs = []
    for v in views:
        n, width, stride = v.numel() // v.shape[-1], v.shape[-1], v.stride(-2) if v.shape[-2] > 1 else v.stride(-3)
        out = torch.empty(n, width, device=v.device, dtype=v.dtype)
        _rows_copy[(triton.cdiv(n, rows_per_program),)](v, out, n, stride, ROWS=rows_per_program, WIDTH=width)
        outs.append(out)
    return outs


def v3_inputs(b, s, heads=128, grad=False):
    q_full = torch.randn(b, s, heads, 192, device=DEV, dtype=BF)
    kv = torch.randn(b, s, 576, device=DEV, dtype=BF)
    q_rot = q_full.transpose(1, 2)[..., 128:]
    k_rot = kv[..., 512:].unsqueeze(1)
    if grad:
        q_rot, k_rot = q_rot.detach().requires_grad_(), k_rot.detach().requires_grad_()
    angles = torch.rand(b, s, 32, device=DEV) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(BF) for f in (torch.cos, torch.sin))
    return q_rot, k_rot, cos, sin


def v4_inputs(b, s, heads=128, grad=False):
    x = torch.randn(b, heads, s, 512, device=DEV, dtype=BF, requires_grad=grad)
    angles = torch.rand(b, s, 32, device=DEV) * 100
    return x, angles.cos().to(BF), angles.sin().to(BF)


def close(got, want, what):
    for g, w in zip(got, want, strict=True):
        bound = 2 * 2.0**-8 * w.abs().amax(-1, keepdim=True) + 1e-30
        assert ((g.double() - w).abs() <= bound).all(), f"{what}: rope differs from transformers' float64 result"


def best(fn):
    return min(graph_us(fn) for _ in range(3))


def with_grad(fn, inputs, ups):
    return lambda: torch.autograd.grad(fn(*inputs), [x for x in inputs if x.requires_grad], ups)


def cell(peer_fn, make):
    return f"{best(make(peer_fn)):.2f}" if peer_fn is not None else "not in this transformers"


def v3(theirs, compiled):
    print("\nDeepSeek-V3, q 128 heads x 64 rope channels of 192, k_rot 1 head, bf16 (µs)")
    print("| case | rope | plain q+k (rope.hf.apply_rotary_pos_emb) | transformers | compiled | clone | "
          "copy into rope's output layout | one-pass copy of the rows where they lie | contiguous copy of as many "
          "bytes | rope / one-pass copy | rope / contiguous copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, s, name in ((1, 4096, "prefill 4K"), (1, 16384, "prefill 16K"), (64, 1, "decode 64")):
        q, k, cos, sin = v3_inputs(b, s)
        if theirs is not None:
            want = theirs(q.double(), k.double(), cos.double(), sin.double())
            close(rope.hf.apply_rotary_pos_emb_interleave(q, k, cos, sin), want, f"V3 {name}")
        ours = best(lambda: rope.hf.apply_rotary_pos_emb_interleave(q, k, cos, sin))  # noqa: B023
        plain = best(lambda: rope.hf.apply_rotary_pos_emb(q, k, cos, sin))  # noqa: B023
        copy = best(lambda: (q.clone(), k.clone()))  # noqa: B023
        # the bytes rope moves, copied: read from the same views into its outputs' layout, and as one contiguous
        # tensor of as many elements (the card's copy bandwidth for that size)
        out_q, out_k = (torch.empty_strided(o.shape, o.stride(), device=DEV, dtype=BF)
                        for o in rope.hf.apply_rotary_pos_emb_interleave(q, k, cos, sin))
        same = best(lambda: (out_q.copy_(q), out_k.copy_(k)))  # noqa: B023
        flat = torch.randn(q.numel() + k.numel(), device=DEV, dtype=BF)
        dense = best(lambda: flat.clone())  # noqa: B023
        # q_rot's rows (b, s, h) lie 192 channels apart, k_rot's (b, s) 576 apart: one pass per view
        q_rows, k_rows = q.transpose(1, 2), k.transpose(1, 2)
        for a, b_ in zip(strided_copy((q_rows, k_rows), 16), (q_rows, k_rows), strict=True):
            assert torch.equal(a, b_.reshape(-1, b_.shape[-1])), "the strided copy is wrong"
        one_pass = min(best(lambda n=n: strided_copy((q_rows, k_rows), n)) for n in (8, 16, 64, 256))  # noqa: B023
        t = cell(theirs, lambda f: lambda: f(q, k, cos, sin))  # noqa: B023
        c = cell(compiled, lambda f: lambda: f(q, k, cos, sin))  # noqa: B023
        print(f"| {name} | {ours:.2f} | {plain:.2f} | {t} | {c} | {copy:.2f} | {same:.2f} | {one_pass:.2f} | "
              f"{dense:.2f} | {one_pass / ours:.3f} | {dense / ours:.3f} |", flush=True)
        qg, kg, cos, sin = v3_inputs(b, s, grad=True)
        ups = [torch.randn(qg.shape, device=DEV, dtype=BF), torch.randn(kg.shape, device=DEV, dtype=BF)]
        ours = best(with_grad(rope.hf.apply_rotary_pos_emb_interleave, (qg, kg, cos, sin), ups))
        t = cell(theirs, lambda f: with_grad(f, (qg, kg, cos, sin), ups))  # noqa: B023
        c = cell(compiled, lambda f: with_grad(f, (qg, kg, cos, sin), ups))  # noqa: B023
        print(f"| {name}, forward + backward | {ours:.2f} | | {t} | {c} | {2 * copy:.2f} (two) | {2 * same:.2f} (two) "
              f"| {2 * one_pass:.2f} (two) | {2 * dense:.2f} (two) | {2 * one_pass / ours:.3f} | "
              f"{2 * dense / ours:.3f} |", flush=True)


def v4(theirs, compiled):
    print("\nDeepSeek-V4, x 128 heads of 512, trailing 64 rotated, bf16 (µs)")
    print("| case | rope | transformers | compiled | clone of x | one-pass Triton copy of x | clone / rope | "
          "Triton copy / rope |")
    print("|---|---|---|---|---|---|---|---|")
    for b, s, name in ((1, 4096, "prefill 4K"), (64, 1, "decode 64")):
        x, cos, sin = v4_inputs(b, s)
        if theirs is not None:
            close((rope.deepseek.apply_rotary_pos_emb(x, cos, sin),), (theirs(x.double(), cos.double(), sin.double()),),
                  f"V4 {name}")
        ours = best(lambda: rope.deepseek.apply_rotary_pos_emb(x, cos, sin))  # noqa: B023
        copy = best(lambda: x.clone())  # noqa: B023
        rows = x.view(-1, x.shape[-2], x.shape[-1])
        assert torch.equal(strided_copy((rows,), 16)[0], x.reshape(-1, x.shape[-1])), "the Triton copy is wrong"
        kernel_copy = min(best(lambda n=n: strided_copy((rows,), n)) for n in (4, 8, 16, 64))  # noqa: B023
        t = cell(theirs, lambda f: lambda: f(x, cos, sin))  # noqa: B023
        c = cell(compiled, lambda f: lambda: f(x, cos, sin))  # noqa: B023
        print(f"| {name} | {ours:.2f} | {t} | {c} | {copy:.2f} | {kernel_copy:.2f} | {copy / ours:.3f} | "
              f"{kernel_copy / ours:.3f} |", flush=True)
        xg, cos, sin = v4_inputs(b, s, grad=True)
        ups = [torch.randn(xg.shape, device=DEV, dtype=BF)]
        ours = best(with_grad(lambda *a: (rope.deepseek.apply_rotary_pos_emb(*a),), (xg, cos, sin), ups))
        t = cell(theirs, lambda f: with_grad(lambda *a: (f(*a),), (xg, cos, sin), ups))  # noqa: B023
        c = cell(compiled, lambda f: with_grad(lambda *a: (f(*a),), (xg, cos, sin), ups))  # noqa: B023
        print(f"| {name}, forward + backward | {ours:.2f} | {t} | {c} | {2 * copy:.2f} (two) | "
              f"{2 * kernel_copy:.2f} (two) | {2 * copy / ours:.3f} | {2 * kernel_copy / ours:.3f} |", flush=True)


def main():
    import transformers
    print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__, transformers.__version__)
    v3_fn = peer("deepseek_v3.modeling_deepseek_v3", "apply_rotary_pos_emb_interleave")
    v4_fn = peer("deepseek_v4.modeling_deepseek_v4", "apply_rotary_pos_emb")
    forms = sys.argv[1:] or ["v3", "v4"]
    if "v3" in forms:
        v3(v3_fn, torch.compile(v3_fn) if v3_fn is not None else None)
    if "v4" in forms:
        v4(v4_fn, torch.compile(v4_fn) if v4_fn is not None else None)


if __name__ == "__main__":
    main()
