"""A/B of this checkout's `rope` against another version of it, in one process: CUDA-graph replay and eager calls,
alternating, public API only; every output compared bitwise between the two first.

    git worktree add /tmp/old 12a4276 && python benchmarks/ab.py --old /tmp/old

The other version's package is copied to a temporary folder as `rope_old`, its custom ops renamed (`rope_old::`), so
that both import side by side. Graph replay: 50 calls per CUDA graph, best of two; eager: medians of nine
alternating rounds of 300 calls, the wall time to the end of the GPU's work and the host time of the loop before its
synchronization (docs/design.md, "Measured").
"""
import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from timing import eager_us, graph_us  # noqa: E402

import rope  # noqa: E402

dev = "cuda"
bf = torch.bfloat16


def load_old(path: str):
    """The `rope` package of the checkout at `path` (or the package folder itself), imported as `rope_old`."""
    root = pathlib.Path(path)
    package = root / "rope" if (root / "rope" / "__init__.py").exists() else root
    folder = pathlib.Path(tempfile.mkdtemp())
    shutil.copytree(package, folder / "rope_old")
    for f in (folder / "rope_old").rglob("*.py"):
        f.write_text(f.read_text().replace('"rope::', '"rope_old::').replace("rope::", "rope_old::"))
    sys.path.insert(0, str(folder))
    import rope_old
    return rope_old


def cases(R):
    out = {}
    # TE sbhd / bshd / thd 4K x 2 x 32 x 128 bf16
    t = torch.randn(4096, 2, 32, 128, device=dev, dtype=bf)
    f = torch.rand(4096, 1, 1, 128, device=dev) * 100
    out["te sbhd 4Kx2x32x128 fwd"] = lambda: R.apply_rotary_pos_emb(t, f, "sbhd", fused=True)
    tb = t.transpose(0, 1).contiguous()
    out["te bshd 4Kx2x32x128 fwd"] = lambda: R.apply_rotary_pos_emb(tb, f, "bshd", fused=True)
    tt = t.reshape(8192, 32, 128)
    cu = torch.tensor([0, 4096, 8192], device=dev, dtype=torch.int32)
    out["te thd 2x4K x32x128 fwd"] = lambda: R.apply_rotary_pos_emb(tt, f, "thd", fused=True, cu_seqlens=cu)
    tg = t.clone().requires_grad_()
    gy = torch.randn_like(t)
    out["te sbhd 4K fwd+bwd"] = lambda: R.apply_rotary_pos_emb(tg, f, "sbhd", fused=True).backward(gy)
    # TE decode with start_positions
    td = torch.randn(1, 64, 32, 128, device=dev, dtype=bf)
    fd = torch.rand(8192, 1, 1, 128, device=dev) * 100
    sp = torch.randint(0, 8000, (64,), device=dev, dtype=torch.int32)
    out["te decode 64 start_positions"] = lambda: R.apply_rotary_pos_emb(td, fd, "sbhd", start_positions=sp,
                                                                        fused=True)
    # transformers: q, k as [b, h, s, d] views of [b, s, h, d]; cos/sin [b, s, d] bf16
    for b, s, name in ((8, 4096, "hf prefill 8x4K"), (1, 4096, "hf prefill 1x4K"), (64, 1, "hf decode 64")):
        qp = torch.randn(b, s, 32, 128, device=dev, dtype=bf).transpose(1, 2)
        kp = torch.randn(b, s, 8, 128, device=dev, dtype=bf).transpose(1, 2)
        ang = torch.rand(b, s, 64, device=dev) * 100
        cos = torch.cat([ang, ang], -1).cos().to(bf)
        sin = torch.cat([ang, ang], -1).sin().to(bf)
        out[name] = (lambda qp=qp, kp=kp, cos=cos, sin=sin: R.hf.apply_rotary_pos_emb(qp, kp, cos, sin))
    # vLLM: positions into an fp32 cos_sin_cache, [T, h*d]
    cache = torch.randn(8192, 128, device=dev)
    for T, name in ((4096, "vllm prefill 4K"), (64, "vllm decode 64")):
        pos = torch.randint(0, 8192, (T,), device=dev)
        q = torch.randn(T, 32 * 128, device=dev, dtype=bf)
        k = torch.randn(T, 8 * 128, device=dev, dtype=bf)
        out[name] = (lambda pos=pos, q=q, k=k: R.vllm.rotary_embedding(pos, q, k, 128, cache, True))
    # QK-RMSNorm + RoPE (transformers' layout)
    qp = torch.randn(1, 4096, 32, 128, device=dev, dtype=bf).transpose(1, 2)
    kp = torch.randn(1, 4096, 8, 128, device=dev, dtype=bf).transpose(1, 2)
    ang = torch.rand(1, 4096, 64, device=dev) * 100
    cos = torch.cat([ang, ang], -1).cos().to(bf)
    sin = torch.cat([ang, ang], -1).sin().to(bf)
    wq = torch.randn(128, device=dev, dtype=bf)
    wk = torch.randn(128, device=dev, dtype=bf)
    out["qknorm 4K fwd"] = lambda: R.qknorm.apply(qp, kp, wq, wk, cos, sin)
    leaves = [x.detach().clone().requires_grad_() for x in (qp, kp, wq, wk)]
    ups = [torch.randn_like(x) for x in (qp, kp)]
    out["qknorm 4K fwd+bwd"] = lambda: torch.autograd.grad(R.qknorm.apply(*leaves, cos, sin), leaves, ups)
    qd = torch.randn(64, 1, 32, 128, device=dev, dtype=bf).transpose(1, 2)
    kd = torch.randn(64, 1, 8, 128, device=dev, dtype=bf).transpose(1, 2)
    angd = torch.rand(64, 1, 64, device=dev) * 100
    cosd, sind = torch.cat([angd, angd], -1).cos().to(bf), torch.cat([angd, angd], -1).sin().to(bf)
    out["qknorm decode 64 fwd"] = lambda: R.qknorm.apply(qd, kd, wq, wk, cosd, sind)
    # QK-RMSNorm + RoPE in TransformerEngine's form: sbhd, angles evaluated from freqs
    qs = torch.randn(4096, 1, 32, 128, device=dev, dtype=bf)
    ks = torch.randn(4096, 1, 8, 128, device=dev, dtype=bf)
    fs = torch.rand(4096, 1, 1, 128, device=dev) * 100
    out["te-qknorm sbhd 4K fwd"] = lambda: R.qknorm.apply_freqs(qs, ks, wq, wk, fs)
    return out


def results(res):
    if isinstance(res, torch.Tensor):
        return [res]
    if res is None:
        return []
    return [r for x in res for r in results(x)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="a checkout (or its rope/ folder) to compare")
    args = parser.parse_args()
    torch.manual_seed(0)
    A = cases(rope)
    torch.manual_seed(0)
    B = cases(load_old(args.old))  # the same inputs, drawn again from the same seed
    print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__)
    for name in A:
        ra, rb = results(A[name]()), results(B[name]())
        same = len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb, strict=True))
        ga, gb, ea, eb, ha, hb = [], [], [], [], [], []
        for _ in range(2):
            gb.append(graph_us(B[name]))
            ga.append(graph_us(A[name]))
        for _ in range(9):  # alternating rounds; medians
            for fn, walls, hosts in ((B[name], eb, hb), (A[name], ea, ha)):
                wall, host = eager_us(fn)
                walls.append(wall)
                hosts.append(host)
        med = statistics.median
        print(f"{name:32s} graph new {min(ga):7.2f} old {min(gb):7.2f} | eager new {med(ea):7.2f} "
              f"old {med(eb):7.2f} | host new {med(ha):6.2f} old {med(hb):6.2f} | "
              f"bitwise {'equal' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
