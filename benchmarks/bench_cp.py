"""Context parallelism's cost: one rank's call (cp_size, cp_rank) against the plain call on the same local tokens.

A rank holds two chunks of each sequence (dual-chunk layout, docs/contract.md section 3), so its call reads
other rows of `freqs` than the plain call on a tensor of the same shape; the work is the same, and the ratio
should be about 1.0. Both are timed as a user runs them: eager (pytest-benchmark) and replayed in a CUDA graph
(`gpu_us`), each in the same run; extra_info holds the graph time and the ratio to the plain call.
    python -m pytest benchmarks/bench_cp.py --benchmark-only -p no:xdist
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: on a CPU only Triton's interpreter would be timed", allow_module_level=True)

from bench_rope import cuda_sync_clock, gpu_us  # noqa: E402

import rope  # noqa: E402

pytestmark = pytest.mark.benchmark(timer=cuda_sync_clock, disable_gc=True, min_time=0.003, max_time=0.2, min_rounds=5,
                                   warmup=True, warmup_iterations=3)

# (name, tensor_format, local tokens per sequence, batch, heads, head dim): Llama-3-8B's q at 8K local tokens per
# rank (16K global at cp 2), and the same tokens packed as thd with four sequences
CASES = [("sbhd-8k", "sbhd", 8192, 1, 32, 128), ("thd-4x2k", "thd", 2048, 4, 32, 128)]
CP = [(1, 0), (2, 0), (2, 1), (4, 3)]


def _call(fmt, s_local, b, h, d, cp_size, cp_rank):
    gen = torch.Generator(device="cuda").manual_seed(0)
    freqs = rope.RotaryPositionEmbedding(d)(s_local * 4).cuda()  # rows for the largest cp_size
    if fmt == "thd":
        t = torch.randn(s_local * b, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        # cu_seqlens counts global tokens: each sequence holds s_local * cp_size of them
        cu = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * (s_local * cp_size)
        return lambda: rope.apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank)
    t = torch.randn(s_local, b, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return lambda: rope.apply_rotary_pos_emb(t, freqs, "sbhd", cp_size=cp_size, cp_rank=cp_rank)


@pytest.mark.parametrize("cp_size,cp_rank", CP, ids=[f"cp{c}-rank{r}" for c, r in CP])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cp_call(benchmark, case, cp_size, cp_rank):
    name, fmt, s_local, b, h, d = case
    fn = _call(fmt, s_local, b, h, d, cp_size, cp_rank)
    benchmark.group = f"cp {name}"
    plain_fn = _call(fmt, s_local, b, h, d, 1, 0)
    plain, gpu = gpu_us(lambda: [plain_fn], 32), gpu_us(lambda: [fn], 32)  # the plain call timed beside it
    benchmark.extra_info.update(case=name, cp_size=cp_size, cp_rank=cp_rank, gpu_us=gpu, plain_gpu_us=plain,
                                gpu_x_plain=gpu / plain)
    with torch.no_grad():
        benchmark(fn)
