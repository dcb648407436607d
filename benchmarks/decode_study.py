"""Decode latency: where the time goes, each part A/B in CUDA graphs of one run.

    python benchmarks/decode_study.py [--calls 40] [--json PATH]

Shapes (bf16, d 128, 64 sequences of one token): transformers' decode q+k (32 q / 8 kv heads, cos/sin per sequence),
TransformerEngine's (sbhd 1 x 64 x 32 x 128 with start_positions), vLLM's (positions into cos_sin_cache) and mRoPE
(Qwen2-VL: 28 q / 4 kv heads, positions [3, 64]). Every time is GPU µs per call, `--calls` calls captured in one
graph and replayed (bench_rope.gpu_us).
1. Floors: an empty kernel; a copy of q+k by one program per token (the kernels below with nothing but the copy).
2. The dependent-load chain, in kernels of this file that differ in one thing each (one program per token, all
   its q and k heads): the copy; plus a table row at the token's own index (two independent loads); plus a row at
   a position loaded first (position -> row -> rotation: the chain of start_positions and vLLM's positions); the
   chain in bfloat16 arithmetic (Liger's numerics); the chain reading both halves of full-width cos/sin rows in
   float32 (rope's contract: one rounding, halves never assumed equal).
3. rope's calls at each shape, and Liger's where it has the form.
4. Tile per token: rope's table-kernel tile for decode-size tensors (`rope._launch._TABLE_ROWS_SMALL` rows; 64
   covers a token's 40 heads, one program per token).
5. PDL (programmatic dependent launch, `rope._launch.PDL`): rope behind a real producer, the q/k projection
   (a bf16 matmul [64, 4096] x [4096, 5120]), matmul + rope with and without PDL, and the matmul alone.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench_rope, and the checkout's rope

import rope  # noqa: E402
import rope._launch as launch  # noqa: E402

B, HQ, HK, D, ROWS = 64, 32, 8, 128, 4096
DT = torch.bfloat16


@triton.jit
def _empty(x_ptr):
    pass


@triton.jit
def _chain(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
           D: tl.constexpr, MODE: tl.constexpr):
    """One token's HEADS rows of x [T, HEADS, D]: MODE 0 copies, 1 rotates by half-table row t [T, D/2], 2 by row
    pos[t]; 3 as 2 in bfloat16 arithmetic (Liger's: packed bf16 multiplies, each product rounded); 4 as 2 with both
    halves of full-width rows [T, D] read, as rope's contract reads cos and sin (it never assumes them equal)."""
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, D // 2)[None, :]
    ok = h < HEADS
    at = t * HEADS * D + h * D + c
    xa = tl.load(x_ptr + at, mask=ok)
    xb = tl.load(x_ptr + at + D // 2, mask=ok)
    if MODE == 0:
        ya, yb = xa, xb
    else:
        row = t if MODE == 1 else tl.load(pos_ptr + t)
        if MODE == 4:
            ca = tl.load(cos_ptr + row * D + c).to(tl.float32)
            cb = tl.load(cos_ptr + row * D + D // 2 + c).to(tl.float32)
            sa = tl.load(sin_ptr + row * D + c).to(tl.float32)
            sb = tl.load(sin_ptr + row * D + D // 2 + c).to(tl.float32)
        else:
            ca = tl.load(cos_ptr + row * (D // 2) + c)
            sa = tl.load(sin_ptr + row * (D // 2) + c)
            if MODE != 3:
                ca, sa = ca.to(tl.float32), sa.to(tl.float32)
            cb, sb = ca, sa
        if MODE == 3:
            ya = xa * ca - xb * sa
            yb = xb * cb + xa * sb
        else:
            fa, fb = xa.to(tl.float32), xb.to(tl.float32)
            ya = (fa * ca - fb * sa).to(xa.dtype)
            yb = (fb * cb + fa * sb).to(xb.dtype)
    tl.store(out_ptr + at, ya, mask=ok)
    tl.store(out_ptr + at + D // 2, yb, mask=ok)


def inputs(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, dtype=DT):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    pos = torch.randint(0, ROWS, (B,), generator=g, device="cuda")
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    angles = torch.arange(ROWS, device="cuda")[:, None].float() * inv  # [ROWS, D/2]
    full = torch.cat([angles, angles], -1)
    return dict(
        q=r(B, 1, HQ, D).transpose(1, 2), k=r(B, 1, HK, D).transpose(1, 2),  # transformers' [b, h, s, d] views
        cos=full[pos][:, None].cos().to(DT), sin=full[pos][:, None].sin().to(DT),  # [b, s, d]
        t=r(1, B, HQ, D), freqs=full[:, None, None, :].contiguous(), start=pos.to(torch.int32),
        cache_rows=torch.cat([angles.cos(), angles.sin()], -1).to(DT), positions=pos,
        query=r(B, HQ * D), key=r(B, HK * D),
        qk=r(B, HQ + HK, D), half_cos=angles.cos().to(DT).contiguous(), half_sin=angles.sin().to(DT).contiguous(),
        full_cos=full.cos().to(DT), full_sin=full.sin().to(DT),
        m_q=r(1, B, 28, D).transpose(1, 2), m_k=r(1, B, 4, D).transpose(1, 2),
        m_pos=torch.randint(0, ROWS, (3, 1, B), generator=g, device="cuda"),
        m_angles=angles, x=r(B, 4096), w=r(4096, (HQ + 2 * HK) * D),
    )


def gpu_us(fn, calls):
    bench_rope = importlib.import_module("bench_rope")
    return round(bench_rope.gpu_us(lambda: [fn], calls), 3)


def chain_calls(a):
    out = torch.empty_like(a["qk"])

    def chain(mode):
        return lambda: _chain[(B,)](a["qk"], out, a["half_cos"], a["half_sin"], a["positions"], HQ + HK, 64, D, mode)
    return {"empty kernel": lambda: _empty[(1,)](out), "copy q+k, a program per token": chain(0),
            "+ table row t (independent loads)": chain(1), "+ row at a loaded position (chain)": chain(2),
            "as the chain, bf16 arithmetic (Liger's)": chain(3),
            "as the chain, full-width cos/sin rows": lambda: _chain[(B,)](a["qk"], out, a["full_cos"], a["full_sin"],
                                                                         a["positions"], HQ + HK, 64, D, 4),
            "torch clone q": lambda: a["query"].clone(), "torch clone q and k": lambda: (a["query"].clone(),
                                                                                        a["key"].clone())}


def mrope_tables(a):
    pos = a["m_pos"]
    ang = torch.cat([a["m_angles"], a["m_angles"]], -1)[pos]  # [3, 1, T, D]
    return ang.cos().to(DT), ang.sin().to(DT)


def rope_calls(a):
    cache = rope.RoPECache.from_freqs(a["freqs"])
    mcos, msin = mrope_tables(a)
    return {
        "hf q+k": lambda: rope.hf.apply_rotary_pos_emb(a["q"], a["k"], a["cos"], a["sin"]),
        "te q, start_positions": lambda: rope.apply_rotary_pos_emb(a["t"], a["freqs"], "sbhd",
                                                                   start_positions=a["start"]),
        "te q, start_positions, RoPECache": lambda: rope.apply_rotary_pos_emb(a["t"], cache, "sbhd",
                                                                              start_positions=a["start"]),
        "vllm q+k": lambda: rope.vllm.rotary_embedding(a["positions"], a["query"], a["key"], D, a["cache_rows"], True),
        "mrope (hf) q+k": lambda: rope.hf.apply_multimodal_rotary_pos_emb(a["m_q"], a["m_k"], mcos, msin,
                                                                          [16, 24, 24]),
    }


def liger_calls(a):
    try:
        hf = importlib.import_module("liger_kernel.transformers.rope").liger_rotary_pos_emb
        mm = importlib.import_module("liger_kernel.transformers.qwen2vl_mrope").liger_multimodal_rotary_pos_emb
    except ImportError as e:
        return {"liger": f"not importable: {e}"}
    mcos, msin = mrope_tables(a)
    # Liger rotates in place, so each call gets copies; q and k in transformers' layout, [b, h, 1, d] views of [b, 1,
    # h, d] memory: Liger takes the row stride from the sequence dim, which for a contiguous [b, h, 1, d] tensor is d,
    # not h * d, and it then rotates the wrong rows (max error 8.4 against float64 on an H200).
    q, k = (a[n].transpose(1, 2).contiguous().transpose(1, 2) for n in ("q", "k"))
    tq, tk = a["t"][0][:, None].clone().transpose(1, 2), a["k"][:, :1].transpose(1, 2).contiguous().transpose(1, 2)
    mq, mk = (a[n].transpose(1, 2).clone().transpose(1, 2) for n in ("m_q", "m_k"))
    return {"liger hf q+k": lambda: hf(q, k, a["cos"], a["sin"]),
            "liger te-shape q (cos per sequence)": lambda: hf(tq, tk, a["cos"], a["sin"]),
            "liger mrope q+k": lambda: mm(mq, mk, mcos, msin, [16, 24, 24])}


def with_setting(name, value, fn):
    """fn() with rope._launch.<name> = value, plans made afresh (the launcher keeps plans per signature)."""
    old = getattr(launch, name)
    setattr(launch, name, value)
    rope.clear_caches()
    try:
        return fn()
    finally:
        setattr(launch, name, old)
        rope.clear_caches()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    a = inputs()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    def part(title, calls):
        res[title] = {}
        print(f"\n{title}")
        for name, fn in calls.items():
            us = fn if isinstance(fn, str) else gpu_us(fn, args.calls)
            res[title][name] = us
            print(f"  {name:45s} {us}")

    part("1-2. floors and the dependent-load chain", chain_calls(a))
    part("3. rope", rope_calls(a))
    part("3. liger", liger_calls(a))
    for rows in (8, 16, 32, 64):  # 8: the tile of table calls whose group is one token, before part 4
        with_setting("_TABLE_ROWS_SMALL", rows,
                     lambda rows=rows: part(f"4. tile per token: {rows} rows", {n: f for n, f in rope_calls(a).items()
                                                                       if not n.startswith("mrope")}))

    def producer():
        return torch.matmul(a["x"], a["w"], out=prod)  # the q/k/v projection, then q and k read from it

    prod = torch.empty(B, (HQ + 2 * HK) * D, device="cuda", dtype=DT)
    q_view, k_view = prod[:, :HQ * D], prod[:, HQ * D:(HQ + HK) * D]

    def pair():
        producer()
        rope.vllm.rotary_embedding(a["positions"], q_view, k_view, D, a["cache_rows"], True)

    def pair_hf():
        producer()
        rope.hf.apply_rotary_pos_emb(q_view.view(B, 1, HQ, D).transpose(1, 2), k_view.view(B, 1, HK, D).transpose(1, 2),
                                     a["cos"], a["sin"])

    part("5. behind a matmul, PDL off", {"matmul alone": producer, "matmul + vllm rope (in place)": pair,
                                         "matmul + hf rope": pair_hf})
    with_setting("PDL", True, lambda: part("5. behind a matmul, PDL on", {
        "matmul + vllm rope (in place)": pair, "matmul + hf rope": pair_hf,
        "vllm q+k alone": rope_calls(a)["vllm q+k"]}))
    with_setting("PDL", True, lambda: check_pdl(a, q_view, k_view, producer))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def check_pdl(a, q_view, k_view, producer):
    """With PDL, the rotation still reads the matmul's output: the result equals the one made without PDL."""
    producer()
    want_q, want_k = q_view.clone(), k_view.clone()
    launch.PDL = False
    rope.clear_caches()
    rope.vllm.rotary_embedding(a["positions"], want_q, want_k, D, a["cache_rows"], True)
    launch.PDL = True
    rope.clear_caches()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        producer()
        rope.vllm.rotary_embedding(a["positions"], q_view, k_view, D, a["cache_rows"], True)  # warm, compile
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=s):
            producer()
            rope.vllm.rotary_embedding(a["positions"], q_view, k_view, D, a["cache_rows"], True)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    ok = torch.equal(q_view, want_q) and torch.equal(k_view, want_k)
    print(f"\nPDL result equals the result without PDL, over 20 replays: {ok}")
    if not ok:
        raise SystemExit("PDL changed the result")


if __name__ == "__main__":
    main()
