"""Which test a pytest-xdist worker runs next: the longest first, on an estimate of each test's time.

A run is as long as its last worker: a long test started late ends it late. pytest-xdist's own load scheduling
hands each worker a run of consecutive tests up front, so a worker can be left with a queue of long properties
while the others idle. Here (`LongestFirst`, for `-n N` with xdist's default `--dist load`) the controller keeps
every test and hands them out one at a time, longest first. A worker always holds two (xdist runs a test only once
it knows the next one), so the second is chosen when the first starts: the longest waiting where the test that
starts is short, else the shortest (a filler), so that the next long test is chosen when a worker frees up rather
than queued behind another long one.

The estimate (`estimate`): a native property takes its examples (the run's profile, `budget.py`) times the cost of
one of its examples relative to a forward example, measured on an NVIDIA H200 over four conventions' certifying
runs (a backward example calls the forward and the backward, an invariant two or three calls, batch invariance the
whole call, each sequence alone and the rolled batch); a property of a convention the target has no call of only
skips. The other tests of 4 s or more are named in LONG with their measured seconds; every other test is short.
Measured on one H200 host against the previous layout (the longest tests dealt to the front of each worker's run
under `--dist worksteal`): certifying `qknorm-cache` with `-n 4` 39.8 s against 52.7 s, `te` 50.0 against 51.2
(docs/conformance.md, "Times").
"""
from __future__ import annotations

import os
import re

from xdist.scheduler import LoadScheduling

# Seconds of one forward example on an H200 (te: 0.20 to 0.27; QK norm's kernels 0.42): the unit of the native
# properties' estimates, so that they compare with LONG's measured seconds.
FORWARD_EXAMPLE_S = 0.25
# One example's time relative to a forward example, by kind of property (H200, te, qknorm, qknorm-cache, flash):
# backward 1.9 to 4.2, determinism 2.0 to 4.8, an invariant 1.1 to 6, batch invariance 1.2 to 7.4.
KIND_WEIGHT = {"forward": 1.0, "backward": 3.0, "determinism": 3.0, "invariant": 2.0, "batch_rows_alone": 4.0}
# Tests other than the native properties that take 4 s or more, by their node id without parameters: the mean
# seconds of a test of that family, the larger of the GPU suite's (H200, 16 workers, two hosts, 2026-11-29) and
# the CPU suite's (2 workers); beside it, both.
LONG = {
    "tests/rope/test_properties.py::test_matches_float64_reference": 39.0,  # H200 39.2, CPU 17.7
    "tests/rope/test_compiled_code.py::test_every_kernel_variant_compiles_for_hopper": 32.0,  # H200 32.3, CPU 2.9
    "tests/conformance/test_zoo.py::test_through_rope_impl": 27.0,  # H200 26.6, CPU 13.4
    "tests/conformance/test_cli.py::test_foreign_target_collects_none_of_ropes_own_tests": 22.0,  # H200 21.5, CPU 9.6
    "tests/conformance/test_budget.py::test_rope_max_examples_reaches_a_property": 19.0,  # H200 18.9, CPU 7.3
    "tests/rope/test_context_parallel_dist.py::test_context_parallel_matches_unsharded": 18.0,  # H200 17.8, CPU 15.1
    "tests/rope/test_mrope.py::test_mrope_permuting_streams_with_sections": 14.0,  # H200 14.2, CPU 2.7
    "tests/conformance/test_cli.py::test_batch_invariance_is_declarable_off": 14.0,  # H200 13.7, CPU 5.4
    "tests/conformance/test_zoo.py::test_declared_off_is_not_drawn": 13.0,  # H200 13.2, CPU 0.6
    "tests/conformance/test_cli.py::test_not_installed_fails_unless_a_skip_is_asked_for": 13.0,  # H200 13.1, CPU 6.7
    "tests/rope/test_streams.py::test_stress_threads_and_streams": 13.0,  # H200 13.1, CPU 0.0
    "tests/conformance/test_stress.py::test_processes_report_their_sum": 12.0,  # H200 11.8, CPU 3.5
    "tests/conformance/test_cli.py::test_conformance_report_of_a_small_run": 11.0,  # H200 11.1, CPU 8.0
    "tests/rope/test_schedules.py::test_eager_verdict_on_16bit_draws": 10.0,  # H200 9.9, CPU 5.6
    "tests/conformance/test_zoo.py::test_bug_needs_its_class": 10.0,  # H200 9.8, CPU 0.6
    "tests/rope/test_mrope.py::test_mrope_keeps_norms_and_inverts": 10.0,  # H200 9.8, CPU 2.4
    "tests/conformance/test_cli.py::test_nothing_tested_is_not_a_pass": 9.0,  # H200 9.5, CPU 4.6
    "tests/rope/test_schedules.py::test_schedule_is_bitwise": 9.0,  # H200 9.2, CPU 1.0
    "tests/rope/test_compile.py::test_fullgraph_matches_eager_and_never_recompiles": 9.0,  # H200 1.7, CPU 8.6
    "tests/rope/test_mrope.py::test_entry_hf_matches_transformers": 8.0,  # H200 7.6, CPU 3.8
    "tests/rope/test_mrope.py::test_entry_vllm_matches_vllm": 7.0,  # H200 6.9, CPU 1.6
    "tests/rope/test_reference_meta.py::test_reference_gradcheck": 6.0,  # H200 6.2, CPU 0.3
    "tests/rope/test_compile.py::test_inductor_fullgraph": 5.0,  # H200 4.9, CPU 0.0
    "tests/conformance/test_zoo.py::test_schedule_verdict": 5.0,  # H200 4.5, CPU 0.6
    "tests/conformance/test_domains.py::test_every_declared_class_is_drawn": 4.0,  # H200 4.4, CPU 0.2
    "tests/rope/test_qknorm.py::test_rows_bitwise_whatever_their_buffer": 4.0,  # H200 4.0, CPU 2.7
    "tests/rope/test_position_table.py::test_thd_positions_from_the_table": 4.0,  # H200 0.7, CPU 3.7
    "tests/rope/test_reference_meta.py::test_reference_matches_explicit_2x2_rotation": 4.0,  # H200 3.6, CPU 0.3
    "tests/rope/test_serving.py::test_fp8_store_equals_the_division_for_every_bf16_value": 4.0,  # H200 0.4, CPU 3.6
}
SHORT_S = 1.0  # a test estimated at most this long is short: it starts in front of a long test's choice
_PROPERTY = re.compile(r"tests/conformance/test_native\.py::test_(forward|backward|determinism|invariant)\[(.+)\]$")


def estimate(nodeid: str, examples, called) -> float:
    """Estimated seconds of a test. examples(kind, (convention, property)) gives a native property's examples;
    called(convention) whether the target has a call of that convention (else its properties only skip)."""
    match = _PROPERTY.search(nodeid)
    if match is None:
        return next((seconds for part, seconds in LONG.items() if part in nodeid), 0.1)
    kind, param = match.groups()
    convention, prop = param, kind
    if kind == "invariant":
        convention, prop = _split_invariant(param)
    if convention is None or not called(convention):
        return 0.0
    weight = KIND_WEIGHT["batch_rows_alone" if prop == "batch_rows_alone" else kind]
    return examples(kind, (convention, prop)) * weight * FORWARD_EXAMPLE_S


def _split_invariant(param: str):
    """(convention, invariant) of test_invariant's id `convention-invariant` (conventions have dashes too)."""
    from tests.conformance.spec import NAMES

    owners = [name for name in NAMES if param.startswith(name + "-")]
    if not owners:
        return None, None
    name = max(owners, key=len)
    return name, param[len(name) + 1:]


def native_examples(kind: str, key: tuple) -> int:
    """The examples a native property runs in this process's profile (budget.examples_for, else the profile's)."""
    from hypothesis import settings

    from tests.conformance import budget

    n = budget.examples_for(kind, budget.current_profile(), os.environ, key)
    return n if n is not None else settings().max_examples


class LongestFirst(LoadScheduling):
    """pytest-xdist's load scheduling, one test at a time, longest first (the module's docstring). cost(nodeid) is
    the estimate in seconds."""

    def __init__(self, config, log=None, cost=None):
        super().__init__(config, log)
        self.cost = cost
        self.seconds: list[float] = []

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:  # a node added later: give it work as any other
            for node in self.nodes:
                self.check_schedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        self.seconds = [self.cost(nodeid) for nodeid in self.collection]
        # stable: equal estimates keep collection order (a file's tests together, as pytest orders them)
        self.pending[:] = sorted(range(len(self.collection)), key=lambda i: -self.seconds[i])
        for node in self.nodes:
            self.check_schedule(node)

    def check_schedule(self, node, duration: float = 0) -> None:
        if node.shutting_down:
            return
        held = self.node2pending[node]
        while len(held) < 2 and self.pending:
            longest = not held or self.seconds[held[0]] <= SHORT_S
            index = self.pending.pop(0 if longest else -1)
            held.append(index)
            node.send_runtest_some([index])
        if not self.pending:
            node.shutdown()
