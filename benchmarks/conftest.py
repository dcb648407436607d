"""pytest-benchmark configuration: machine info (GPU, torch, triton) and the session's copy bandwidth."""
from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    # Registered here too so the suite collects (and skips) cleanly without pytest-benchmark.
    config.addinivalue_line("markers", "benchmark: pytest-benchmark settings")


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    from rope.bench.machine import machine_info as describe

    info = describe("cuda" if HAS_CUDA else "cpu")
    machine_info["gpu"] = {k: info.get(k) for k in ("gpu", "capability", "sm_count", "gpu_memory_gib", "l2_mib")}
    machine_info["torch"] = info["torch"]
    machine_info["triton"] = info["triton"]
    machine_info["cuda"] = info.get("cuda")


@pytest.fixture(scope="session")
def copy_gbps():
    """Device-to-device copy bandwidth (bytes read + written), measured once per session."""
    from rope.bench.timing import copy_bandwidth

    gbps, _ = copy_bandwidth("cuda")
    return gbps


def pytest_collection_modifyitems(config, items):
    # `pytest -q` is the test command everywhere, a GPU machine included: timing runs only when
    # asked for, so that the test run stays short and its timings are not mistaken for benchmarks.
    asked = config.getoption("benchmark_only", False) or config.getoption("benchmark_enable", False)
    if asked:
        return
    skip = pytest.mark.skip(reason="benchmarks run with `pytest --benchmark-only`")
    for item in items:
        if "benchmarks" in item.path.parts:
            item.add_marker(skip)
