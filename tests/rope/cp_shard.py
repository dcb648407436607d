"""Context parallelism on a real process group: the dual-chunk layout and the per-rank worker.

Layout (docs/contract.md section 3): a sequence of global length G = 2 * cp * c is cut into 2 * cp chunks of
c tokens; rank r holds chunk r followed by chunk 2 * cp - 1 - r, a local sequence of 2c tokens.
Pairing an early chunk with a late one is what balances causal attention across ranks, and it is
why a rank's positions are not contiguous. For thd every packed sequence is cut this way on its
own, and every rank keeps the *global* cu_seqlens (the API divides them by cp_size).

This module imports neither `rope` nor `triton` at the top: a spawned child unpickles `worker`
by importing this module, and Triton's interpreter must be chosen (TRITON_INTERPRET=1) before
Triton is first imported. The child does not run the top-level conftest.py that does it for pytest.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from dataclasses import dataclass

import torch

FORMATS_SEQ_DIM = {"sbhd": 0, "bshd": 1, "thd": 0}


# ---- the layout --------------------------------------------------------------------------------


def shard(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of one sequence laid along `dim`: chunk rank, then chunk 2cp-1-rank."""
    n = x.shape[dim]
    assert n % (2 * cp) == 0, f"sequence length {n} is not a multiple of 2 * cp = {2 * cp}"
    c = n // (2 * cp)
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * cp - 1 - rank) * c, c)], dim)


def unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of `shard`: the global sequence from every rank's part (parts[r] from rank r)."""
    cp = len(parts)
    c = parts[0].shape[dim] // 2
    chunks = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank] = part.narrow(dim, 0, c)
        chunks[2 * cp - 1 - rank] = part.narrow(dim, c, c)
    return torch.cat(chunks, dim)


def shard_thd(x: torch.Tensor, cu_seqlens: list[int], cp: int, rank: int) -> torch.Tensor:
    """thd: every packed sequence sharded on its own, the rank's pieces packed in sequence order."""
    pieces = [shard(x[a:b], 0, cp, rank) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    return torch.cat(pieces) if pieces else x[:0]


def unshard_thd(parts: list[torch.Tensor], cu_seqlens: list[int]) -> torch.Tensor:
    """Inverse of `shard_thd`; the local sequence q of every rank spans cu_seqlens[q..q+1] / cp."""
    cp = len(parts)
    local = [v // cp for v in cu_seqlens]
    pieces = [unshard([p[a:b] for p in parts], 0) for a, b in zip(local[:-1], local[1:], strict=True)]
    return torch.cat(pieces) if pieces else parts[0][:0]


def shard_any(x, fmt, cu_seqlens, cp, rank):
    return shard_thd(x, cu_seqlens, cp, rank) if fmt == "thd" else shard(x, FORMATS_SEQ_DIM[fmt], cp, rank)


def unshard_any(parts, fmt, cu_seqlens):
    return unshard_thd(parts, cu_seqlens) if fmt == "thd" else unshard(parts, FORMATS_SEQ_DIM[fmt])


# ---- the cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One global problem. sbhd/bshd: G = 2 * cp * c tokens per sequence, b sequences; thd: the
    global lengths `seqlens` (each a multiple of 2 * cp, empty ones allowed). `cuda_only` cases are
    too large for Triton's CPU interpreter and run only when the ranks compute on GPUs."""

    name: str
    fmt: str
    dtype: torch.dtype
    h: int
    d: int
    rot_dim: int
    interleaved: bool = False
    c: int = 0
    b: int = 1
    seqlens: tuple = ()
    cuda_only: bool = False
    max_start: int = -1  # >= 0: start_positions in [0, max_start], the same on every rank

    @property
    def n_seqs(self):
        return len(self.seqlens) if self.fmt == "thd" else self.b

    def global_shape(self, cp):
        if self.fmt == "thd":
            return (sum(self.seqlens), self.h, self.d)
        g = 2 * cp * self.c
        return (g, self.b, self.h, self.d) if self.fmt == "sbhd" else (self.b, g, self.h, self.d)

    def max_len(self, cp):
        return max(self.seqlens, default=0) if self.fmt == "thd" else 2 * cp * self.c

    def cu_seqlens(self):
        cu = [0]
        for n in self.seqlens:
            cu.append(cu[-1] + n)
        return cu


# Every format, both pairings (half-split and interleaved), full and partial rotary, the three
# dtypes, and thd with sequences of different lengths including empty ones (an empty sequence
# must not shift the local offsets of the ones after it).
CASES = {
    2: [
        Case("sbhd_fp32_halfsplit", "sbhd", torch.float32, h=2, d=16, rot_dim=16, c=3, b=2),
        Case("bshd_bf16_interleaved_partial", "bshd", torch.bfloat16, h=1, d=24, rot_dim=16, interleaved=True,
             c=2, b=3),
        Case("thd_fp32_interleaved", "thd", torch.float32, h=2, d=8, rot_dim=8, interleaved=True,
             seqlens=(8, 0, 12, 4)),
        Case("thd_bf16_halfsplit_partial", "thd", torch.bfloat16, h=2, d=16, rot_dim=12, seqlens=(4, 16, 0)),
        Case("sbhd_bf16_large", "sbhd", torch.bfloat16, h=8, d=128, rot_dim=128, c=512, b=2, cuda_only=True),
        Case("thd_bf16_interleaved_large", "thd", torch.bfloat16, h=8, d=128, rot_dim=64, interleaved=True,
             seqlens=(2048, 0, 516, 1000), cuda_only=True),
        # start_positions with context parallelism: p = cp_position(j) + start_positions[seq]
        Case("sbhd_fp32_start", "sbhd", torch.float32, h=2, d=16, rot_dim=12, c=3, b=3, max_start=9),
        Case("bshd_fp16_interleaved_start", "bshd", torch.float16, h=1, d=16, rot_dim=16, interleaved=True, c=2,
             b=2, max_start=5),
        Case("thd_fp32_start", "thd", torch.float32, h=2, d=8, rot_dim=8, seqlens=(8, 0, 12, 4), max_start=6),
        Case("bshd_bf16_start_large", "bshd", torch.bfloat16, h=8, d=128, rot_dim=128, c=256, b=2, max_start=100,
             cuda_only=True),
        Case("thd_bf16_start_large", "thd", torch.bfloat16, h=8, d=128, rot_dim=64, seqlens=(1024, 0, 260, 2000),
             max_start=50, cuda_only=True),
    ],
    3: [
        Case("sbhd_bf16_interleaved", "sbhd", torch.bfloat16, h=2, d=16, rot_dim=16, interleaved=True, c=2, b=2),
        Case("bshd_fp32_halfsplit_partial", "bshd", torch.float32, h=2, d=16, rot_dim=8, c=2, b=2),
        Case("thd_fp32_halfsplit", "thd", torch.float32, h=2, d=16, rot_dim=16, seqlens=(6, 0, 18, 12)),
        Case("thd_fp16_interleaved_partial", "thd", torch.float16, h=1, d=12, rot_dim=8, interleaved=True,
             seqlens=(0, 12, 6, 0)),
        Case("bshd_fp16_large", "bshd", torch.float16, h=4, d=64, rot_dim=32, c=300, b=3, cuda_only=True),
        Case("sbhd_bf16_interleaved_start", "sbhd", torch.bfloat16, h=2, d=16, rot_dim=8, interleaved=True, c=2,
             b=2, max_start=7),
        Case("thd_fp16_start", "thd", torch.float16, h=1, d=12, rot_dim=12, seqlens=(0, 12, 6, 18), max_start=3),
        Case("sbhd_fp32_start_large", "sbhd", torch.float32, h=4, d=64, rot_dim=64, c=200, b=3, max_start=64,
             cuda_only=True),
    ],
}


def cases_for(cp: int, on_cuda: bool) -> list[Case]:
    return [case for case in CASES[cp] if on_cuda or not case.cuda_only]


def global_inputs(case: Case, cp: int, seed: int):
    """(x, g, freqs, start_positions) of the unsharded problem, on the CPU, the same in every process
    for a seed.

    freqs are random angles whose halves differ (the contract is elementwise), a few rows longer
    than the longest sequence needs (after its start position); start_positions is None unless
    the case has them."""
    gen = torch.Generator().manual_seed(seed)
    shape = case.global_shape(cp)
    x = torch.randn(shape, generator=gen).to(case.dtype)
    g = torch.randn(shape, generator=gen).to(case.dtype)
    rows = case.max_len(cp) + max(case.max_start, 0) + 3
    freqs = (torch.rand((rows, 1, 1, case.rot_dim), generator=gen, dtype=torch.float64) * 10).float()
    start = None
    if case.max_start >= 0:
        start = torch.randint(0, case.max_start + 1, (case.n_seqs,), generator=gen)
    return x, g, freqs, start


# ---- the worker: one rank of the process group ----------------------------------------------------


def _first_difference(a, b):
    diff = (a.double() - b.double()).abs()
    bad = ~(a == b)
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return f"{int(bad.sum())} of {bad.numel()} elements differ, first at {idx}, max |diff| {diff.max().item():.3g}"


def _check_case(case, cp, rank, impl, device, comm_device, dist):
    """Shard, rotate per rank, all_gather, reassemble; rank 0 compares. Returns failure messages.

    Every rank runs the same collectives in the same order whatever the outcome, so one failing
    comparison cannot leave the others waiting."""
    from rope import reference
    from tests.rope.numerics import assert_within_rounding

    seed = 1000 * cp + sum(map(ord, case.name))
    x, g, freqs, start = global_inputs(case, cp, seed)
    cu = case.cu_seqlens() if case.fmt == "thd" else None
    kw = {"tensor_format": case.fmt}
    if start is not None:
        kw["start_positions"] = start.to(device)
    if case.interleaved:
        kw["interleaved"] = True
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)  # the global cu_seqlens
    freqs_dev = freqs.to(device)

    x_local = shard_any(x, case.fmt, cu, cp, rank).to(device).requires_grad_()
    g_local = shard_any(g, case.fmt, cu, cp, rank).to(device)
    out_local = impl(x_local, freqs_dev, cp_size=cp, cp_rank=rank, **kw)
    out_local.backward(g_local)

    gathered = {}
    for what, local in (("input", x_local), ("output", out_local), ("grad", x_local.grad)):
        send = local.detach().to(comm_device).contiguous()
        parts = [torch.empty_like(send) for _ in range(cp)]
        dist.all_gather(parts, send)
        gathered[what] = unshard_any([p.cpu() for p in parts], case.fmt, cu)
    if rank != 0:
        return []

    failures = []
    # the reassembly itself: the ranks' inputs put back in global order are the global input
    if not torch.equal(gathered["input"], x):
        failures.append(f"{case.name}: gathered inputs do not reassemble to the global input")

    x_full = x.to(device, copy=True).requires_grad_()
    out_full = impl(x_full, freqs_dev, **kw)
    out_full.backward(g.to(device))
    x64 = x.double().requires_grad_()  # x itself never requires grad: x64 is a leaf
    kw_cpu = dict(kw, **({} if cu is None else {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}),
                  **({} if start is None else {"start_positions": start}))
    ref = reference.apply_rotary_pos_emb(x64, freqs, **kw_cpu)
    ref.backward(g.double())
    for what, got, full, ref64, inp in (("forward", gathered["output"], out_full, ref, x),
                                        ("backward", gathered["grad"], x_full.grad, x64.grad, g)):
        full = full.detach().cpu()
        # Same kernel, same float32 angle freqs[p] for every token, elementwise arithmetic: the
        # sharded and unsharded results must agree bit for bit.
        if not torch.equal(got, full):
            failures.append(f"{case.name} (cp_size={cp}) {what}: sharded and gathered != unsharded: "
                            f"{_first_difference(got, full)}")
        try:  # and both within one rounding of the float64 oracle
            assert_within_rounding(got, ref64.detach(), inp, case.rot_dim, case.interleaved,
                                   f"{case.name} (cp_size={cp}) {what} against the float64 reference")
        except AssertionError as e:
            failures.append(str(e))
    return failures


def worker(rank, cp, backend, init_file, result_dir, timeout_s):
    """Entry of one spawned rank. Writes result_dir/rank<r>.json: cases checked, failures, error."""
    result = {"rank": rank, "checked": [], "failures": [], "error": None}
    try:
        on_cuda = torch.cuda.is_available()
        if not on_cuda:
            os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (rope does)
        if backend == "nccl":
            os.environ["NCCL_NVLS_ENABLE"] = "0"
            os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        import torch.distributed as dist

        import rope
        import rope._launch

        impl = rope.apply_rotary_pos_emb
        if not on_cuda and not rope._launch.INTERPRET:
            raise RuntimeError("Triton interpreter off on a CPU-only rank: rope would run its reference, "
                               "not the kernel")
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = comm_device = torch.device("cuda", rank)
        else:  # gloo talks through CPU tensors; the ranks still compute on a GPU when there is one
            device, comm_device = torch.device("cuda" if on_cuda else "cpu"), torch.device("cpu")
        # device_id binds NCCL's communicator to this rank's GPU up front (no guess at the barrier)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=cp,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if backend == "nccl" else {}))
        try:
            for case in cases_for(cp, device.type == "cuda"):
                result["failures"] += _check_case(case, cp, rank, impl, device, comm_device, dist)
                result["checked"].append(case.name)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        result["error"] = traceback.format_exc()
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(1 if result["error"] else 0)
