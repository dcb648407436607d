"""pytest plugin for run.sh (`-p tests.te_check.plugin`): sharding, xdist memory grouping, peak memory.

TE_SHARD=i/N   keep the tests whose crc32(node id) % N == i: N disjoint shards that together are the
               whole file, each a similar mix (plain round-robin would follow the parametrize period,
               so some shards would be mostly skips). Node ids are `test_fused_rope.py::...` (run.sh
               sets --rootdir to the folder of TE's test file), so a shard is the same set of tests
               wherever TE's checkout lies.
TE_WORKERS=n   (run.sh turns it into -n n --dist loadgroup) puts the packed-QKV tests that need more
               than 8 GiB of CUDA memory (up to 31.5 GiB: fp32, s=4096, hidden 256) into one xdist
               group, so that they run one at a time on one worker: n workers then fit an 80 GB GPU
               for n <= 4 (31.5 + 3 x 8 GiB), a 141 GB one for n <= 8. After each test the worker
               hands its cached CUDA blocks back (torch.cuda.empty_cache).
TE_PEAK_MEM=1  record torch.cuda.max_memory_allocated() per test; report the largest at the end.
"""
import os
import zlib

import pytest

BIG_GIB = 8  # packed-QKV tests above this peak go to the one-at-a-time group
_peaks = []


def qkv_peak_gib(item):
    """Peak CUDA memory of one test_fused_qkv_rope case, from the peak measured on an H100 (torch 2.11):
    31.5 GiB at fp32, seq_length 4096, hidden_size 256, scaling with seq_length * hidden_size * itemsize.
    None for every other test (all measured below 8 GiB)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.originalname != "test_fused_qkv_rope" or "seq_length" not in params:
        return None
    return 31.5 * params["seq_length"] / 4096 * params["hidden_size"] / 256 * params["dtype"].itemsize / 4


def shard_of(nodeid: str, n: int) -> int:
    return zlib.crc32(nodeid.encode()) % n


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TE_WORKERS"):
        for item in items:
            gib = qkv_peak_gib(item)
            if gib is not None and gib > BIG_GIB:
                item.add_marker(pytest.mark.xdist_group("bigmem"))
    shard = os.environ.get("TE_SHARD")
    if not shard:
        return
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"TE_SHARD={shard}: expected i/N, e.g. 0/6") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"TE_SHARD={shard}: expected i/N with 0 <= i < N")
    mine = [item for item in items if shard_of(item.nodeid, n) == i]
    config.hook.pytest_deselected(items=[item for item in items if shard_of(item.nodeid, n) != i])
    items[:] = mine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    track = os.environ.get("TE_PEAK_MEM") == "1"
    if track:
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if track:
        _peaks.append((torch.cuda.max_memory_allocated() / 2**30, item.nodeid))


def pytest_runtest_teardown(item):
    """With several workers, hand each test's cached blocks back to the GPU: PyTorch's caching allocator
    keeps them otherwise, and 4 workers on an H100 then reached 78 of 80 GB (measured)."""
    if os.environ.get("TE_WORKERS"):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def pytest_terminal_summary(terminalreporter):
    if _peaks:
        terminalreporter.write_line("peak CUDA memory per test, largest first (GiB):")
        for gib, nodeid in sorted(_peaks, reverse=True)[:8]:
            terminalreporter.write_line(f"  {gib:7.2f}  {nodeid}")
