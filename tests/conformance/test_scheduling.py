"""tests/scheduling.py: pytest-xdist's load distribution, longest first, driven here as xdist's controller drives
it, with workers simulated (a worker runs a test once it holds the next one, or once told nothing follows)."""
from __future__ import annotations

import heapq
from pathlib import Path

import pytest

pytest.importorskip("xdist.scheduler")  # the scheduler is pytest-xdist's; without it nothing is scheduled

from tests import scheduling  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NATIVE = "tests/conformance/test_native.py::"


class FakeNode:
    """What the scheduler calls on one of pytest-xdist's worker controllers."""

    def __init__(self, name):
        self.name, self.shutting_down, self.sent = name, False, []
        self.gateway = type("Gateway", (), {"id": f"gw{name}"})()

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


class FakeConfig:
    """What xdist's LoadScheduling reads of pytest's config: the workers (--tx) and --maxschedchunk."""

    def __init__(self, workers, dist="load"):
        self.values = {"tx": ["popen"] * workers, "dist": dist}

    def getvalue(self, name):
        return self.values[name]

    def getoption(self, name):
        return self.values.get(name)


def drive(seconds: dict, estimates: dict, workers: int, scheduler=scheduling.LongestFirst):
    """Run the tests (id: seconds) on `workers` simulated workers under the scheduler given the estimates; returns
    (the time the last one ends, [the tests each worker started, in order])."""
    ids = list(seconds)
    sched = scheduler(FakeConfig(workers), cost=estimates.__getitem__)
    nodes = [FakeNode(i) for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, ids)
    sched.schedule()
    started, busy = [[] for _ in nodes], [False] * workers
    running, clock, end = [], 0.0, 0.0

    def start_idle_workers():
        for i, node in enumerate(nodes):
            held = sched.node2pending[node]
            if not busy[i] and held and (len(held) >= 2 or node.shutting_down):
                busy[i] = True
                started[i].append(ids[held[0]])
                heapq.heappush(running, (clock + seconds[ids[held[0]]], i, held[0]))

    start_idle_workers()
    while running:
        clock, i, index = heapq.heappop(running)
        end, busy[i] = max(end, clock), False
        sched.mark_test_complete(nodes[i], index)
        start_idle_workers()
    assert sched.tests_finished and not sched.pending
    sent = sorted(index for node in nodes for index in node.sent)
    assert sent == list(range(len(ids))), "a test sent twice or never"
    assert sorted(t for run in started for t in run) == sorted(ids), "a test run twice or never"
    return end, started


def four_long_and_fillers(fillers=30):
    long = {"a": 40.0, "b": 30.0, "c": 20.0, "d": 10.0}
    short = {f"s{i}": 0.1 for i in range(fillers)}
    return {**short, **long}  # collection order: the short tests first, as a file's order may have them


def test_long_tests_are_chosen_when_a_worker_frees():
    """Two workers, tests of 40, 30, 20 and 10 s among thirty of 0.1 s, collected last: the scheduler starts the 40
    and the 30, gives each worker a short test as its next one, and hands the 20 and the 10 to whichever frees
    first; the run ends within 2 % of an even split."""
    seconds = four_long_and_fillers()
    end, started = drive(seconds, seconds, workers=2)
    assert [run[0] for run in started] == ["a", "b"]
    assert all(run[1].startswith("s") for run in started), started
    assert "c" in started[1] and "d" in started[0], started
    assert end <= 1.02 * sum(seconds.values()) / 2, (end, started)


def test_estimates_wrong_by_a_factor_still_start_long_tests_first():
    """Estimates off by up to 3 times, with their order kept, give the same run within 5 % of an even split."""
    seconds = four_long_and_fillers()
    estimates = {t: s * (3 if t in "ac" else 1 / 3) for t, s in seconds.items()}
    end, _ = drive(seconds, estimates, workers=2)
    assert end <= 1.05 * sum(seconds.values()) / 2


class QueueingNext(scheduling.LongestFirst):
    """A planted bug: the next test is always the longest waiting (a worker queues two long tests)."""

    def check_schedule(self, node, duration=0):
        held = self.node2pending[node]
        while len(held) < 2 and self.pending:
            index = self.pending.pop(0)
            held.append(index)
            node.send_runtest_some([index])
        if not self.pending:
            node.shutdown()


class CollectionOrder(scheduling.LongestFirst):
    """A planted bug: the tests in collection order (the long ones last)."""

    def schedule(self):
        super().schedule()
        self.pending.sort()


@pytest.mark.parametrize("bug", [QueueingNext, CollectionOrder])
def test_planted_schedulers_are_caught(bug):
    """Each planted scheduler fails the bound of test_long_tests_are_chosen_when_a_worker_frees."""
    seconds = four_long_and_fillers()
    end, _ = drive(seconds, seconds, workers=2, scheduler=bug)
    assert end > 1.02 * sum(seconds.values()) / 2


@pytest.mark.parametrize("workers,tests", [(1, 5), (3, 2), (4, 0), (16, 100), (2, 3)])
def test_every_test_runs_once(workers, tests):
    """Whatever the counts (fewer tests than workers, none at all), each test is sent and run exactly once, and
    every worker is told when nothing follows (drive's checks)."""
    seconds = {f"t{i}": float((i * 7) % 5) for i in range(tests)}
    end, _ = drive(seconds, seconds, workers)
    assert end >= max(seconds.values(), default=0.0)


def test_estimate_of_a_native_property():
    """examples x the kind's weight x a forward example's seconds; an invariant's id split at the longest convention
    name (conventions have dashes too); a convention the target has no call of costs nothing (it only skips)."""
    asked = []

    def examples(kind, key):
        asked.append((kind, key))
        return 20

    called = {"te-qknorm", "te"}.__contains__
    brs = scheduling.estimate(NATIVE + "test_invariant[te-qknorm-batch_rows_alone]", examples, called)
    assert asked[-1] == ("invariant", ("te-qknorm", "batch_rows_alone"))
    assert brs == 20 * scheduling.KIND_WEIGHT["batch_rows_alone"] * scheduling.FORWARD_EXAMPLE_S
    fwd = scheduling.estimate(NATIVE + "test_forward[te]", examples, called)
    assert asked[-1] == ("forward", ("te", "forward")) and fwd == 20 * scheduling.FORWARD_EXAMPLE_S
    assert scheduling.estimate(NATIVE + "test_determinism[te]", examples, called) == 3 * fwd
    assert scheduling.estimate(NATIVE + "test_backward[hf]", examples, called) == 0.0
    assert scheduling.estimate(NATIVE + "test_pinned[te-3]", examples, called) == 0.1


def test_estimate_of_other_tests():
    """A test named in LONG takes its seconds; any other, a tenth of a second."""
    part, seconds = next(iter(scheduling.LONG.items()))
    assert scheduling.estimate(part + "[x]", None, None) == seconds
    assert scheduling.estimate("tests/rope/test_core.py::test_x", None, None) == 0.1


def test_native_examples_follow_the_budget():
    """A native property's examples are budget.py's for the run's profile, else the profile's own."""
    from hypothesis import settings

    from tests.conformance import budget

    for kind, key in (("forward", ("te", "forward")), ("invariant", ("te", "inverse"))):
        want = budget.examples_for(kind, budget.current_profile(), {}, key) or settings().max_examples
        assert scheduling.native_examples(kind, key) == want


def test_the_load_distribution_is_the_suites(request):
    """conftest.py hands pytest-xdist's load distribution (its default for -n N) to LongestFirst, any other --dist
    mode to xdist."""
    (conftest,) = [p for p in request.config.pluginmanager.get_plugins()
                   if getattr(p, "__file__", None) == str(ROOT / "conftest.py")]
    plugin = conftest.LongestFirstScheduler(type("Target", (), {"fns": {"te": None}})())
    sched = plugin.pytest_xdist_make_scheduler(FakeConfig(2), log=None)
    assert isinstance(sched, scheduling.LongestFirst)
    assert sched.cost(NATIVE + "test_forward[hf]") == 0.0 and sched.cost(NATIVE + "test_forward[te]") > 0
    assert plugin.pytest_xdist_make_scheduler(FakeConfig(2, dist="worksteal"), log=None) is None
