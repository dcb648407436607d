"""Context parallelism end to end on a real `torch.distributed` process group (docs/contract.md section 7).

Each test spawns cp_size processes that form one process group: NCCL with one GPU per rank where
the machine has cp_size GPUs, gloo otherwise (CPU tensors and Triton's interpreter in CI). Every
rank builds the same global inputs from a fixed seed, takes its dual-chunk shard of every sequence
(tests/rope/cp_shard.py), runs `apply_rotary_pos_emb(..., cp_size, cp_rank)` (with the same global
`start_positions` on every rank in some cases) forward and backward with
the matching shard of the upstream gradient, and all_gathers inputs, outputs and input gradients.
Rank 0 puts them back in global order and compares with the unsharded call: bitwise (the same
kernel computes the same float32 expression from the same angle for every token) and within one
rounding of the float64 reference.

On a machine with two or more GPUs:
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest tests/rope/test_context_parallel_dist.py
"""
from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection
import time

import pytest
import torch

from .cp_shard import CASES, shard, shard_thd, unshard, unshard_thd, worker

# A hang guard, not a performance limit: the CPU-interpreter runs take a few seconds per group.
TIMEOUT_S = 180


def _backend(cp: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= cp else "gloo"


# ---- the layout, checked without a process group --------------------------------------------


@pytest.mark.parametrize("cp, want", [
    (2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    (3, [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]),
])
def test_dual_chunk_layout(cp, want):
    """Rank r holds chunk r, then chunk 2cp-1-r (docs/contract.md section 3); unshard is its inverse."""
    g = torch.arange(4 * cp)
    parts = [shard(g, 0, cp, r) for r in range(cp)]
    assert [p.tolist() for p in parts] == want
    assert torch.equal(unshard(parts, 0), g)


def test_dual_chunk_layout_thd():
    """thd: each sequence is sharded on its own; an empty sequence contributes nothing."""
    cu = [0, 4, 4, 12]
    g = torch.arange(12)
    parts = [shard_thd(g, cu, 2, r) for r in range(2)]
    assert [p.tolist() for p in parts] == [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]
    assert torch.equal(unshard_thd(parts, cu), g)


# ---- the process group -----------------------------------------------------------------------------


def _run_group(cp, backend, tmp_path):
    """Spawn the ranks, wait (bounded), and return each rank's result; a crash or hang fails here."""
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no forked CUDA or Triton state
    procs = [ctx.Process(target=worker, args=(rank, cp, backend, str(tmp_path / "pg_init"), str(tmp_path), TIMEOUT_S),
                         daemon=True)
             for rank in range(cp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        pending = list(procs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            multiprocessing.connection.wait([p.sentinel for p in pending], timeout=left)
            pending = [p for p in pending if p.exitcode is None]
            if any(p.exitcode for p in procs):  # one rank failed: the others may wait forever on it
                break
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.exitcode is None]
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()

    results, problems = [], []
    for rank, p in enumerate(procs):
        path = tmp_path / f"rank{rank}.json"
        res = json.loads(path.read_text()) if path.exists() else None
        results.append(res)
        if res is not None and res["error"]:
            problems.append(f"rank {rank} raised:\n{res['error']}")
        elif rank in hung:
            problems.append(f"rank {rank} still running after {TIMEOUT_S} s (or stopped because a peer failed)")
        elif res is None or p.exitcode != 0:
            problems.append(f"rank {rank} exited with code {p.exitcode} without a result")
    # a rank that fails makes its peers fail in their next collective ("connection closed"): the
    # cause is in the other rank's report
    assert not problems, "\n".join(problems)
    return results


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_matches_unsharded(cp, tmp_path, monkeypatch):
    """Sharded over a real process group, rotated per rank, gathered: equal to the unsharded call."""
    backend = _backend(cp)
    if backend == "nccl":  # children inherit the environment; the worker sets them again itself
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
        monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    results = _run_group(cp, backend, tmp_path)
    on_cuda = torch.cuda.is_available()
    want = [c.name for c in CASES[cp] if on_cuda or not c.cuda_only]
    for res in results:  # every rank went through every case: none was skipped
        assert res["checked"] == want, f"rank {res['rank']} checked {res['checked']}, expected {want}"
    failures = [f for res in results for f in res["failures"]]
    assert not failures, f"{len(failures)} mismatches ({backend}, cp_size={cp}):\n" + "\n".join(failures)
