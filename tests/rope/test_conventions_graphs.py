"""CUDA-graph capture of every convention, replayed after its inputs change in place: positions, the
vLLM cos_sin_cache, transformers' cos/sin, flash-attention's seqlen_offsets and a `RoPECache` (through
`update_`). Each replay must read the values the tensors hold then, checked against eager calls on
the same values. Warmed up first on a side stream (compiles; a capture may not load a module)."""
from __future__ import annotations

import torch

import rope

from .cases import DEVICE, gpu_only, oracle, per_pair

pytestmark = gpu_only


def _r(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def _angles(rows, cols, gen):
    return (torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 20 - 10).to(DEVICE)


def _capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def test_graphs_follow_tables_and_positions_changed_in_place():
    gen = torch.Generator().manual_seed(11)
    # vLLM: in place on copies made inside the graph, positions and cache changed between replays
    n_tokens, hq, hk, hs, rot, rows = 37, 4, 2, 64, 32, 100
    positions = torch.randint(0, rows, (n_tokens,), generator=gen).to(DEVICE)
    cache = torch.empty(rows, rot, device=DEVICE)
    q_in = _r(n_tokens, hq * hs, gen=gen, dtype=torch.bfloat16)
    k_in = _r(n_tokens, hk * hs, gen=gen, dtype=torch.bfloat16)
    # transformers: cos/sin per batch entry
    b, s, h, d = 2, 9, 4, 64
    hq_in, hk_in = _r(b, h, s, d, gen=gen), _r(b, 1, s, d, gen=gen)
    hf_cos, hf_sin = torch.empty(b, s, d, device=DEVICE), torch.empty(b, s, d, device=DEVICE)
    # flash: offsets per sequence
    fx = _r(3, 8, 2, 32, gen=gen, dtype=torch.float16)
    f_cos, f_sin = torch.empty(20, 8, device=DEVICE, dtype=torch.float16), torch.empty(20, 8, device=DEVICE,
                                                                                       dtype=torch.float16)
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    # TransformerEngine with a RoPECache
    t_sb = _r(12, 2, 3, 64, gen=gen)
    rcache = rope.RoPECache.from_freqs(_angles(12, 48, gen).view(12, 1, 1, 48))

    def refill():
        positions.copy_(torch.randint(0, rows, (n_tokens,), generator=gen))
        th = _angles(rows, rot // 2, gen)
        cache.copy_(torch.cat([th.cos(), th.sin()], -1))
        th = _angles(b * s, d // 2, gen)
        hf_cos.copy_(per_pair(th.cos(), False).view(b, s, d))
        hf_sin.copy_(per_pair(th.sin(), False).view(b, s, d))
        th = _angles(20, 8, gen)
        f_cos.copy_(th.cos())
        f_sin.copy_(th.sin())
        offsets.copy_(torch.randint(0, 13, (3,), generator=gen))
        new = _angles(12, 48, gen).view(12, 1, 1, 48).float()  # the angles the cache is made of
        rcache.update_(new)
        return new

    def step():
        q, k = q_in.clone(), k_in.clone()
        rope.vllm.rotary_embedding(positions, q, k, hs, cache, True)
        return (q, k, *rope.hf.apply_rotary_pos_emb(hq_in, hk_in, hf_cos, hf_sin),
                rope.flash.apply_rotary_emb(fx, f_cos, f_sin, interleaved=True, seqlen_offsets=offsets),
                rope.apply_rotary_pos_emb(t_sb, rcache, interleaved=True))

    refill()
    graph, outs = _capture(step)
    for replay in range(3):
        new_freqs = refill()
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for i, (got, want) in enumerate(zip(outs, eager, strict=True)):
            assert torch.equal(got, want), f"output {i}, replay {replay}: the replay read other values"
        # and the eager values are right: the oracle on the new tables
        pos = torch.arange(8, device=DEVICE)[None, :] + offsets[:, None].long()
        want = oracle(fx, per_pair(f_cos, True)[pos][:, :, None], per_pair(f_sin, True)[pos][:, :, None], True)
        torch.testing.assert_close(outs[4].double(), want, rtol=2**-10, atol=2**-10)
        want = rope.reference.apply_rotary_pos_emb(t_sb.double(), new_freqs, interleaved=True)
        torch.testing.assert_close(outs[5].double(), want, rtol=2**-20, atol=2**-20)
