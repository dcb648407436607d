"""Top-level pytest configuration.

Without a CUDA device the Triton kernels run in Triton's interpreter on CPU tensors. The
interpreter is chosen by TRITON_INTERPRET=1, which Triton reads when it is first imported, so it
is set here, before any test module imports `rope` (and with it, `triton`).
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_without_overflow_asserts():
    """Triton's interpreter asserts after every int32 add, sub and mul that it did not overflow
    (compiled GPU code does not, unless built for debugging): about a quarter of an interpreted
    launch's time. At the CPU suite's sizes (a
    few thousand elements per tensor) the kernel's int32 indices stay far below 2**31, so the
    asserts cannot fire; the range that matters is guarded by the launcher
    (`rope._launch._check_index_range`, tested). Where this Triton keeps its options elsewhere,
    nothing changes."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_without_overflow_asserts()

# pytest-xdist workers share the host's cores: each worker's PyTorch would otherwise start one
# CPU thread per core for the tests' input generation and reference work, so 16 workers on 16 cores
# would run 256 threads, and the Triton compiles that bound the GPU suite would wait for them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# ---- Hypothesis profiles (after the interpreter switch: nothing above imports triton) --------
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
# CI default: Triton's interpreter on the CPU. Small shapes (tests/strategies.py LIMITS), the same
# examples every run, no example database, no targeting phase (its extra runs cost minutes). 20 examples per
# property: the whole CPU suite, the native conventions' properties included, must fit CI's 15 minutes on 2
# cores. The properties' coverage comes from the GPU profile (100 examples, realistic shapes) and the nightly
# one; here they check that every path runs and agrees with float64 on small shapes.
settings.register_profile("cpu-interp", max_examples=20, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink], **_COMMON)
# On the device: realistic shapes up to tens of MB per tensor. Compile-bound, not GPU-bound: nearly
# every drawn (dtype, d, d2, mode, direction, tile) is a new Triton specialization (about 500 in 600
# draws), compiled in about a second each; hence 100 examples per property, and `-n auto`
# (pytest-xdist, workers share Triton's on-disk cache) to spread the compiles over the host's cores,
# with `--dist worksteal` so that no worker is left with a queue of properties. On an H200 host with
# 16 cores the whole suite takes over 6 minutes (on 2026-11-26, 97 % of it had run after 400 s).
settings.register_profile("gpu", max_examples=100, **_COMMON)
# Long hunt: thousands of examples; the accuracy checks call hypothesis.target() on the error
# relative to the allowed bound, steering generation towards the worst case.
settings.register_profile("nightly", max_examples=4000, **_COMMON)

_PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("gpu" if HAS_CUDA else "cpu-interp")
if os.environ.get("ROPE_MAX_EXAMPLES"):  # e.g. a quick smoke run of a large profile
    settings.register_profile(_PROFILE, settings.get_profile(_PROFILE),
                              max_examples=int(os.environ["ROPE_MAX_EXAMPLES"]))
settings.load_profile(_PROFILE)


# ---- the implementation under test -------------------------------------------------------------
import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Without a CUDA device, `pytest` runs on every core (pytest-xdist, work stealing) unless told
    otherwise (`-n N`, `-n 0`, `-p no:xdist`).

    The CPU suite is bound by Triton's interpreter, one core per process: on CI's 2-core machine
    one process takes about twice as long as two. Runs that pytest-xdist
    would change are left alone: collection only, `--pdb`, and `--benchmark-only` (pytest-benchmark
    switches itself off under xdist). Runs before xdist's hook of the same name (both are tryfirst,
    and a conftest registers later, so it is called first), which turns the worker count into
    workers; its workers (PYTEST_XDIST_WORKER) must not start workers of their own.
    """
    opt = config.option
    if (HAS_CUDA or getattr(opt, "numprocesses", 0) is not None or os.environ.get("PYTEST_XDIST_WORKER")
            or opt.collectonly or opt.usepdb or getattr(opt, "benchmark_only", False) or (os.cpu_count() or 1) < 2):
        return
    opt.numprocesses = "auto"
    if opt.dist == "no":
        opt.dist = "worksteal"


def pytest_addoption(parser):
    parser.addoption(
        "--rope-impl", default="rope:apply_rotary_pos_emb", metavar="SPEC",
        help="implementation to run the conformance tests against: te, flash, liger, hf, vllm or rope (named), "
             "liger-mrope, hf-mrope, vllm-mrope or rope-mrope (named multimodal RoPE), module:callable "
             "(TransformerEngine's apply_rotary_pos_emb signature), or CONVENTION:module:callable for a callable in "
             "one of the conventions te, flash, liger, hf, vllm, hf-mrope, vllm-mrope, mrope (tests/adapters; "
             "default: rope:apply_rotary_pos_emb)")
    parser.addoption(
        "--rope-caps", default="", metavar="KEY=VALUE,...",
        help="capabilities the --rope-impl target declares where it differs from its convention's defaults, e.g. "
             "'gqa=false,dtypes=float32' (tests/conformance/spec lists them); also read from the callable's "
             "rope_capabilities attribute or its module's ROPE_CAPABILITIES")
    parser.addoption(
        "--rope-allow-missing", action="store_true",
        help="a named --rope-impl that is not installed ends the run as skipped (exit status 0) instead of failing "
             "it: for CI jobs that run where a peer may be absent")
    parser.addoption(
        "--conformance-report", default=None, metavar="PATH",
        help="write the implementation x property table (pass / fail with the shrunk counterexample / not "
             "supported with the reason) to PATH: Markdown, or JSON when PATH ends in .json")


def _target(config):
    from tests.target import load_target

    return load_target(config.getoption("--rope-impl"), config.getoption("--rope-caps"))


def pytest_configure(config):
    """A --rope-impl that cannot be loaded stops the run with one short line, before collection: a usage error.
    A named implementation that is not installed fails the run too (nothing was tested), naming how to install
    it; with --rope-allow-missing it ends as skipped (exit status 0)."""
    from tests.target import Unavailable

    spec = config.getoption("--rope-impl")
    try:
        target = _target(config)
    except Unavailable as e:
        if config.getoption("--rope-allow-missing"):
            pytest.exit(f"SKIPPED --rope-impl {spec}: {e}", returncode=0)
        raise pytest.UsageError(f"--rope-impl {spec}: {e} (nothing was tested; --rope-allow-missing makes this "
                                f"a skip)") from None
    except Exception as e:  # noqa: BLE001 - any failure to import or resolve is a usage error
        raise pytest.UsageError(f"--rope-impl {spec}: {type(e).__name__}: {e}") from None
    path = config.getoption("--conformance-report")
    if path and not hasattr(config, "workerinput"):  # the controller collects every worker's reports
        from tests.adapters.report import ConformanceReport

        config.pluginmanager.register(ConformanceReport(path, target, _PROFILE), "rope-conformance-report")


def pytest_report_header(config):
    return [f"rope-impl: {config.getoption('--rope-impl')}, hypothesis profile: {_PROFILE}"]


@pytest.fixture(scope="session")
def target(request):
    return _target(request.config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Calls outside the target's capabilities are rejected examples (tests/target.py); a property whose every
    example was rejected (Hypothesis: Unsatisfiable) is skipped with the reasons, not failed. The reasons and
    counts go into the report (user property rope_narrowed)."""
    from hypothesis.errors import Unsatisfiable

    from tests.target import REJECTED

    REJECTED.clear()
    try:
        return (yield)
    except Unsatisfiable:
        if not REJECTED:
            raise
        pytest.skip("not supported: " + "; ".join(REJECTED))
    finally:
        if REJECTED:
            item.user_properties.append(("rope_narrowed", dict(REJECTED)))


# The Hypothesis properties are the longest tests by far (1-3 minutes each in the GPU profile,
# about as long as all the others together on 16 workers). Collected first, they start at once on
# separate pytest-xdist workers; in file order they formed a serial tail on a few workers (an
# H200 host: the whole GPU suite took over 9 minutes that way, the properties alone 4.6).
_LONGEST_FIRST = ("test_properties.py", "test_invariants.py")


def pytest_collection_modifyitems(config, items):
    """Longest tests first; a foreign target skips the tests of this package's own internals
    (`ours_only`, test_core), and the property tests that need a capability it lacks (tests/adapters).
    Every test of the target is tagged with its property name (user property rope_property) for the
    conformance report."""
    from tests.adapters.report import property_name

    items.sort(key=lambda item: item.path.name not in _LONGEST_FIRST)  # stable: file order otherwise
    target = _target(config)
    no_te_call = pytest.mark.skip(reason=f"{target.name} has no call in TransformerEngine's convention")
    for item in items:
        name = property_name(item)
        if name is None:
            continue
        item.user_properties.append(("rope_property", name))
        if target.fn is None and "conformance" not in item.path.parts:
            item.add_marker(no_te_call)
            continue
        why = target.caps.missing_for(name)
        if why:
            item.add_marker(pytest.mark.skip(reason=f"not supported by {target.name}: {why}"))
    if target.is_ours:
        return
    skip = pytest.mark.skip(reason="concerns the rope package itself, not the --rope-impl target")
    for item in items:
        if item.get_closest_marker("ours_only") or item.path.name == "test_core.py":
            item.add_marker(skip)
