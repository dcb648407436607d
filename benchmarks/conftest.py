"""pytest configuration of the benchmarks: what runs under `--benchmark-only` and what does not, the
machine in pytest-benchmark's JSON, and the peers that are not installed, named at the end."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo

HERE = Path(__file__).resolve().parent

# The compiled peers (transformers' paths under torch.compile) are one function each, compiled once per case:
# Dynamo's default limit of 8 recompilations per function would be reached after a few cases, and the rest would
# then run eagerly and be reported as compiled.
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 256)


def pytest_collection_modifyitems(config, items):
    """`--benchmark-only` deselects the tests (pytest-benchmark would skip them one by one, a line of
    "s" each). Without it the benchmarks skip: `pytest -q` is the test command, on a GPU machine too."""
    if config.getoption("benchmark_only", False):
        tests = [item for item in items if HERE not in item.path.parents]
        if tests:
            config.hook.pytest_deselected(items=tests)
            items[:] = [item for item in items if HERE in item.path.parents]
    elif not config.getoption("benchmark_enable", False):
        skip = pytest.mark.skip(reason="benchmarks run with `pytest --benchmark-only`")
        for item in items:
            if HERE in item.path.parents:
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    # Without a GPU the benchmark module skips and `--benchmark-only` deselects the rest: that is a
    # pass, not pytest's "no tests collected" (exit status 5, which CI treats as a failure).
    if (exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and not torch.cuda.is_available()
            and session.config.getoption("benchmark_only", False)):
        session.exitstatus = pytest.ExitCode.OK


def pytest_terminal_summary(terminalreporter, config):
    if torch.cuda.is_available() and config.getoption("benchmark_only", False):  # bench_rope.py leaves them out
        from peers import IMPLS

        for name, cls in IMPLS.items():
            if cls().missing():
                terminalreporter.write_line(f"{name}: not timed, {cls().missing()}")


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    import triton

    machine_info.update(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        machine_info["gpu"] = dict(name=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                                   memory_gib=round(p.total_memory / 2**30, 1), l2_mib=p.L2_cache_size / 2**20)
