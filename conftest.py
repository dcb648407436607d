"""Top-level pytest configuration.

Without a CUDA device the Triton kernels run in Triton's interpreter on CPU tensors. The
interpreter is chosen by TRITON_INTERPRET=1, which Triton reads when it is first imported, so it
is set here, before any test module imports `rope` (and with it, `triton`).
"""
import os
from pathlib import Path

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
# CI default: Triton's interpreter on the CPU. Small shapes (tests/rope/strategies.py LIMITS), the same
# examples every run, no example database, no targeting phase (its extra runs cost minutes). 20 examples per
# property of rope's own tests; the native properties take test_native.py's CPU_EXAMPLES in this profile alone.
# The whole CPU suite must fit CI's 12 minutes on 2 cores (docs/conformance.md gives the measured times). The
# properties' coverage comes from the GPU profile (100 examples, realistic shapes) and the nightly one; here they
# check that every path runs and agrees with float64 on small shapes.
settings.register_profile("cpu-interp", max_examples=20, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink], **_COMMON)
# On the device: realistic shapes up to tens of MB per tensor. Compile-bound, not GPU-bound: nearly
# every drawn (dtype, d, d2, mode, direction, tile) is a new Triton specialization (about 500 in 600
# draws), compiled in about a second each; hence 100 examples per property, and `-n auto`
# (pytest-xdist, workers share Triton's on-disk cache) to spread the compiles over the host's cores,
# the longest tests first (tests/scheduling.py; docs/conformance.md gives the measured times).
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
    """Without a CUDA device, `pytest` runs on every core (pytest-xdist, the suite's scheduler:
    tests/scheduling.py) unless told otherwise (`-n N`, `-n 0`, `-p no:xdist`).

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


def pytest_addoption(parser):
    from tests.conformance.registry import NAMED
    from tests.conformance.spec import NAMES

    parser.addoption(
        "--rope-impl", default="rope", metavar="SPEC",
        help=f"implementation the conformance suite (tests/conformance) certifies: a named one ({', '.join(NAMED)}: "
             f"every convention it has), or CONVENTION:module:callable for one callable in one of the conventions "
             f"{', '.join(NAMES)} (tests/conformance/spec). Default: rope, this package, whose own tests (tests/rope) "
             f"run only then")
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
        "--rope-schedule", default=None, metavar="NAME",
        help="also certify that the target is bitwise equal to a named PyTorch schedule of its convention on every "
             "draw (test_native.py's test_schedule): eager (the convention's own expression in the input dtype, as "
             "transformers writes it) or float32 (float32 math, one rounding); a convention without that schedule "
             "is skipped, naming it")
    parser.addoption(
        "--conformance-report", default=None, metavar="PATH",
        help="write the implementation x property table of the native properties (pass / fail with the shrunk "
             "counterexample / not supported with the reason) to PATH: Markdown, or JSON when PATH ends in .json")


def _target(config):
    """The --rope-impl target as the native registry resolves it (tests.conformance.registry.Native), named."""
    from tests.conformance.registry import resolve

    spec = config.getoption("--rope-impl")
    return resolve(spec, config.getoption("--rope-caps"))._replace(name=spec)


def _is_ours(config) -> bool:
    from tests.conformance.registry import OURS

    return config.getoption("--rope-impl").strip() in OURS


def pytest_configure(config):
    """A --rope-impl that cannot be loaded stops the run with one short line, before collection: a usage error.
    A named implementation none of whose conventions is installed fails the run too (nothing was tested), naming
    how to install it; with --rope-allow-missing it ends as skipped (exit status 0)."""
    from tests.conformance.registry import DISTRIBUTIONS, NAMED

    spec = config.getoption("--rope-impl")
    try:
        target = _target(config)
    except Exception as e:  # noqa: BLE001 - any failure to import or resolve is a usage error
        raise pytest.UsageError(f"--rope-impl {spec}: {type(e).__name__}: {e}") from None
    if spec in NAMED and not target.fns:
        why = "; ".join(f"{conv}: {err}" for conv, err in target.missing.items())
        install = DISTRIBUTIONS.get(spec, ((), ""))[1]
        line = f"not installed here ({why})" + (f"; install it with: {install}" if install else "")
        if config.getoption("--rope-allow-missing"):
            pytest.exit(f"SKIPPED --rope-impl {spec}: {line}", returncode=0)
        raise pytest.UsageError(f"--rope-impl {spec}: {line} (nothing was tested; --rope-allow-missing makes this "
                                f"a skip)")
    if hasattr(config, "workerinput"):  # the controller collects every worker's reports
        return
    config.pluginmanager.register(TargetTested(target, _is_ours(config)), "rope-target-tested")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(LongestFirstScheduler(target), "rope-longest-first")
    path = config.getoption("--conformance-report")
    if path:
        from tests.conformance.report import ConformanceReport

        config.pluginmanager.register(ConformanceReport(path, target, _PROFILE), "rope-conformance-report")


def pytest_report_header(config):
    lines = [f"rope-impl: {config.getoption('--rope-impl')}, hypothesis profile: {_PROFILE}"]
    if os.environ.get("TRITON_INTERPRET") == "1" and not _is_ours(config):
        # Triton's interpreter gets bfloat16 arithmetic wrong (docs/conformance.md, the verdicts table): a foreign
        # Triton kernel that computes in bfloat16 fails here for the interpreter's sake, not its own
        lines.append("Triton interpreter: a Triton kernel's bfloat16 arithmetic is wrong here; a target that computes "
                     "in bfloat16 is certified on a GPU, or here with --rope-caps dtypes=float32+float16,"
                     "mixed_tables=false")
    return lines


@pytest.fixture(scope="session")
def schedule(request):
    """The --rope-schedule name, or None."""
    return request.config.getoption("--rope-schedule")


@pytest.fixture(scope="session")
def target(request):
    """The implementation under test: `tests.conformance.registry.Native` ({convention: callable}, capabilities)."""
    return _target(request.config)


_OWN_TESTS = Path(__file__).resolve().parent / "tests" / "rope"


def _own_test(path) -> bool:
    return _OWN_TESTS == Path(path).resolve() or _OWN_TESTS in Path(path).resolve().parents


def pytest_ignore_collect(collection_path, config):
    """rope's own tests (tests/rope) concern this package, not a foreign --rope-impl target: not collected then
    (those named on the command line are deselected: pytest collects a path given there whatever this says)."""
    if _own_test(collection_path) and not _is_ours(config):
        return True
    return None


class LongestFirstScheduler:
    """pytest-xdist's load distribution (`-n N`, its default `--dist load`) by tests/scheduling.py: the controller
    hands the tests out one at a time, longest first on an estimate of each, so that no worker is left with a queue
    of long properties. Another `--dist` mode is xdist's own."""

    def __init__(self, target):
        self.called = set(target.fns)

    @pytest.hookimpl(tryfirst=True)  # before xdist's own, which answers for every mode
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "load":
            return None
        from tests import scheduling

        return scheduling.LongestFirst(config, log, cost=lambda nodeid: scheduling.estimate(
            nodeid, scheduling.native_examples, self.called.__contains__))


class TargetTested:
    """Nothing tested is not a pass: a run that collected tests of the target, or whose target is foreign, and in
    which no test of the target executed (every one skipped, or none selected) ends with a line saying so and exit
    status 5, as pytest's own for a run that collected nothing. Counted on the controller, from every worker's
    reports (a test of the target carries the user property rope_property)."""

    def __init__(self, target, ours: bool):
        self.name, self.ours = target.name, ours
        self.seen, self.executed = 0, 0
        self.nothing_tested = False

    def pytest_runtest_logreport(self, report):
        if not any(key == "rope_property" for key, _ in report.user_properties):
            return
        self.seen += report.when == "setup"
        self.executed += report.when == "call" and report.outcome in ("passed", "failed")

    def pytest_sessionfinish(self, session):
        self.nothing_tested = not session.config.option.collectonly and (self.seen or not self.ours) \
            and not self.executed
        if self.nothing_tested and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED

    def pytest_terminal_summary(self, terminalreporter):
        if self.nothing_tested:
            terminalreporter.write_line(
                f"NOTHING TESTED: no property of the conformance suite ran against --rope-impl {self.name} "
                f"({self.seen} of its tests collected{', every one skipped' if self.seen else ''}): not a pass",
                red=True)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    """rope's own tests deselected under a foreign target; every test of the target tagged with its property name
    (user property rope_property), for the conformance report and for the count of what ran against the target."""
    from tests.conformance.report import property_name

    if not _is_ours(config):
        own = [item for item in items if _own_test(item.path)]
        if own:
            config.hook.pytest_deselected(items=own)
            items[:] = [item for item in items if not _own_test(item.path)]
    for item in items:
        name = property_name(item)
        if name is not None:
            item.user_properties.append(("rope_property", name))
