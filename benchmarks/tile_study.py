"""The table kernel's program size on transformers' layout: q and k as [b, h, s, d] views of the [b, s, h, d]
projection, cos/sin [b, s, d] in bf16 (a row per token of each sequence). Each variant sets the launcher's tiles per
program for such tables and the bytes each thread moves per row-half, and is timed by CUDA-graph replay (50 calls, best
of three) beside `clone` of the same q and k, in one process; every variant's output is first compared bitwise with
the launcher's own.

    python benchmarks/tile_study.py
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from timing import graph_us  # noqa: E402

import rope  # noqa: E402
from rope import _launch, _memo  # noqa: E402

DEV = "cuda"
CASES = ((8, 4096, 32, 8), (1, 4096, 32, 8), (4, 4096, 64, 8), (2, 4096, 40, 40), (64, 1, 32, 8))
# (tiles per program, bytes per thread per row-half): the launcher's choice first
VARIANTS = ((_launch._TABLE_TILES_PER_SEQUENCE_ROW, _launch._TABLE_BYTES_PER_THREAD_SMALL), (1, 32), (1, 16), (2, 16),
            (4, 16), (8, 32), (16, 16))


def inputs(b, s, hq, hk, dtype=torch.bfloat16):
    q = torch.randn(b, s, hq, 128, device=DEV, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, hk, 128, device=DEV, dtype=dtype).transpose(1, 2)
    angles = torch.rand(b, s, 64, device=DEV) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


def set_variant(tiles, bytes_per_thread):
    _launch._TABLE_TILES_PER_SEQUENCE_ROW = tiles
    _launch._TABLE_BYTES_PER_THREAD_SMALL = bytes_per_thread  # the small-tensor tile too: large cases only here
    _memo.clear()


def study(b, s, hq, hk, chosen):
    q, k, cos, sin = inputs(b, s, hq, hk)
    set_variant(*chosen)
    want = rope.hf.apply_rotary_pos_emb(q, k, cos, sin)
    print(f"b {b} s {s} heads {hq}/{hk}: clone {graph_us(lambda: (q.clone(), k.clone())):.2f} µs", flush=True)
    for tiles, bpt in VARIANTS:
        set_variant(tiles, bpt)
        same = all(torch.equal(g, w) for g, w in zip(rope.hf.apply_rotary_pos_emb(q, k, cos, sin), want, strict=True))
        t = min(graph_us(lambda: rope.hf.apply_rotary_pos_emb(q, k, cos, sin)) for _ in range(3))
        c = graph_us(lambda: (q.clone(), k.clone()))
        print(f"  tiles {tiles:2d}, {bpt} B/thread: {t:8.2f} µs, {c / t:.3f} x clone ({c:.2f}), "
              f"{'bitwise equal' if same else 'DIFFERENT'}", flush=True)
    set_variant(*chosen)
    t = min(graph_us(lambda: rope.hf.apply_rotary_pos_emb(q, k, cos, sin, schedule="eager")) for _ in range(3))
    print(f"  schedule='eager': {t:8.2f} µs", flush=True)


def main():
    print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__)
    for case in CASES:
        study(*case, VARIANTS[0])


if __name__ == "__main__":
    main()
