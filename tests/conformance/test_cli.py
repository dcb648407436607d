"""The command line of the conformance suite, as a user runs it: `--rope-impl` (a missing named implementation, a
module that does not import, a run in which nothing of the target was tested) and `--conformance-report`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import report

ROOT = Path(__file__).resolve().parents[2]
NATIVE = "tests/conformance/test_native.py"
# transformers' apply_rotary_pos_emb in plain PyTorch: a foreign target that is correct in the hf convention
TINY_HF = '''
import torch


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim).float(), sin.unsqueeze(unsqueeze_dim).float()
    r = cos.shape[-1]  # channels past the tables' width pass through

    def embed(x):
        xr = x[..., :r].float()
        return torch.cat([(xr * cos + rotate_half(xr) * sin).to(out), x[..., r:].to(out)], dim=-1)

    return embed(q), embed(k)
'''
# each run a pytest session of its own in one interpreter (torch and Triton start once): its status and its output
SESSIONS = '''
import json, sys
import pytest
for i, args in enumerate(json.loads(sys.argv[1])):
    print(f"@@@ run {i}", flush=True)
    status = pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", *args])
    print(f"@@@ status {i} {int(status)}", flush=True)
'''


def _pytest(*args, env=None, timeout=300):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=timeout)


def _sessions(runs: list, tmp_path, env=None, timeout=600) -> list:
    """[(exit status, output)] of one pytest session per argument list, tmp_path importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
           **(env or {})}
    done = subprocess.run([sys.executable, "-c", SESSIONS, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)
    out = []
    for i in range(len(runs)):
        assert f"@@@ status {i} " in done.stdout, \
            f"run {i} did not finish:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        text = done.stdout.split(f"@@@ run {i}\n", 1)[1].split(f"@@@ status {i} ", 1)
        out.append((int(text[1].split()[0]), text[0]))
    return out


def test_nothing_tested_is_not_a_pass(tmp_path):
    """A run in which no property ran against the target ends with a line saying so and exit status 5: every test of
    the target skipped (a foreign hf callable asked for flash-attention's properties), or none collected (rope's own
    tests, which a foreign target does not run). A run that tests the target passes as before; one that tests
    this package's own internals alone is not a run of the conformance suite, and passes too."""
    (tmp_path / "tinyrope.py").write_text(TINY_HF)
    impl = "--rope-impl=hf:tinyrope:apply_rotary_pos_emb"
    runs = [[impl, f"{NATIVE}::test_forward[flash]", f"{NATIVE}::test_backward[flash]"],
            [impl, "tests/rope/test_memo.py"],
            [impl, f"{NATIVE}::test_forward[hf]"],
            ["tests/rope/test_memo.py"]]
    (skipped, out_skipped), (rope_own, out_rope_own), (tested, out_tested), (ours, out_ours) = \
        _sessions(runs, tmp_path, env={"ROPE_MAX_EXAMPLES": "3"})
    line = "NOTHING TESTED: no property of the conformance suite ran against --rope-impl hf:tinyrope"
    assert skipped == 5 and line in out_skipped and "2 skipped" in out_skipped, out_skipped[-3000:]
    assert rope_own == 5 and line in out_rope_own and "2 deselected" in out_rope_own, out_rope_own[-3000:]
    assert "passed" not in out_rope_own, out_rope_own[-3000:]
    assert tested == 0 and "NOTHING TESTED" not in out_tested and "1 passed" in out_tested, out_tested[-3000:]
    assert ours == 0 and "NOTHING TESTED" not in out_ours and "2 passed" in out_ours, out_ours[-3000:]


def test_batch_invariance_is_declarable_off(tmp_path):
    """A target whose math follows the batch (the zoo's hf math_depends_on_batch) fails batch_rows_alone; declared
    batch_invariant=false, that invariant is skipped with a reason naming the declaration, and the run still
    certifies the rest (its forward passes)."""
    impl = "--rope-impl=hf:tests.conformance.zoo.hf:math_depends_on_batch"
    invariant = f"{NATIVE}::test_invariant[hf-batch_rows_alone]"
    runs = [[impl, invariant],
            [impl, "--rope-caps", "batch_invariant=false", "-rs", invariant, f"{NATIVE}::test_forward[hf]"]]
    # 10 examples: the bug shows where float64 and float32 math round a value apart, which the CI default's 4 need
    # not draw
    (caught, out_caught), (declared, out_declared) = _sessions(runs, tmp_path, env={"ROPE_MAX_EXAMPLES": "10"})
    assert caught == 1 and "batch invariance" in out_caught and "1 failed" in out_caught, out_caught[-3000:]
    assert declared == 0 and "declares hf not batch invariant" in out_declared, out_declared[-3000:]
    assert "1 passed, 1 skipped" in out_declared, out_declared[-3000:]


def test_foreign_target_collects_none_of_ropes_own_tests(tmp_path):
    (tmp_path / "tinyrope.py").write_text(TINY_HF)
    env = {"PYTHONPATH": str(tmp_path)}
    foreign = _pytest("--collect-only", "-q", "--rope-impl=hf:tinyrope:apply_rotary_pos_emb", "tests", env=env)
    ours = _pytest("--collect-only", "-q", "tests", env=env)
    assert foreign.returncode == ours.returncode == 0, foreign.stdout[-3000:] + ours.stdout[-3000:]
    foreign_ids = [ln for ln in foreign.stdout.splitlines() if "::" in ln]
    ours_ids = [ln for ln in ours.stdout.splitlines() if "::" in ln]
    assert foreign_ids and not [n for n in foreign_ids if n.startswith("tests/rope/")], foreign.stdout[-3000:]
    assert [n for n in ours_ids if n.startswith("tests/rope/")], ours.stdout[-3000:]
    assert set(foreign_ids) == {n for n in ours_ids if not n.startswith("tests/rope/")}


def test_unknown_module_is_a_usage_error_naming_it(request):
    # the top-level conftest.py as pytest loaded it (`import conftest` may find benchmarks/conftest.py)
    (conftest,) = [p for p in request.config.pluginmanager.get_plugins()
                   if getattr(p, "__file__", None) == str(ROOT / "conftest.py")]

    class Config:  # the little of pytest's config that conftest.pytest_configure reads before it fails
        def getoption(self, name):
            return {"--rope-impl": "hf:no_such_module_xyz:f", "--rope-caps": ""}[name]

    with pytest.raises(pytest.UsageError) as info:
        conftest.pytest_configure(Config())
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and "no_such_module_xyz" in msg and msg.startswith("--rope-impl hf:"), msg


def test_not_installed_fails_unless_a_skip_is_asked_for(tmp_path):
    """A named implementation that does not import (here a flash_attn whose CUDA extension is missing, as on a
    CPU-only install) ends the run before collection with one line naming how to install it: a failure (nothing was
    tested, so a CI job must not pass), or with --rope-allow-missing a skip (exit 0)."""
    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'flash_attn_2_cuda'\")\n")
    env = {"PYTHONPATH": str(tmp_path)}
    failed = _pytest("--rope-impl", "flash", NATIVE, env=env)
    assert failed.returncode == 4, failed.stdout + failed.stderr
    out = [ln for ln in (failed.stdout + failed.stderr).splitlines() if ln.strip()]
    assert len(out) == 1 and out[0].startswith("ERROR: --rope-impl flash:") and "nothing was tested" in out[0], out
    skipped = _pytest("--rope-impl", "flash", "--rope-allow-missing", NATIVE, env=env)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    out = [ln for ln in (skipped.stdout + skipped.stderr).splitlines() if ln.strip()]
    assert len(out) == 1 and "SKIPPED --rope-impl flash" in out[0], out
    assert "pip install flash-attn" in out[0] and "flash_attn_2_cuda" in out[0], out


# ---- the report ---------------------------------------------------------------------------------------------------

def test_conformance_report_of_a_small_run(tmp_path):
    """--conformance-report on a planted bug (k rotated with q's rotate_half): failures with Hypothesis' shrunk example
    and the message, and a convention the target does not have as not supported, with the reason."""
    out = tmp_path / "report.md"
    done = _pytest("--rope-impl=hf:tests.conformance.zoo.hf:k_rotates_q", f"--conformance-report={out}",
                   f"{NATIVE}::test_forward[hf]", f"{NATIVE}::test_invariant[hf-swap_q_k]",
                   f"{NATIVE}::test_forward[flash]", env={"ROPE_MAX_EXAMPLES": "10"})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"written to {out}" in done.stdout
    text = out.read_text()
    assert "| hf: forward | **fail** |" in text, text
    assert "| flash: forward | n/s: hf:tests.conformance.zoo.hf:k_rotates_q has no flash call |" in text, text
    assert "| hf | yes |" in text and "| hf: invariant swap_q_k | **fail** |" in text, text
    failure = text.split("## Failures", 1)[1]
    assert "AssertionError: forward" in failure and "Failing test case" in failure, failure
    assert "(plan): Plan(" in failure, failure  # Hypothesis' shrunk draw


def test_report_as_json(tmp_path):
    from .registry import Native

    class Rep:  # the parts of a pytest TestReport the plugin reads
        def __init__(self, when, outcome, props, longrepr=None):
            self.when, self.nodeid, self.user_properties, self.longrepr = when, "t.py::test_x", props, longrepr
            self.passed, self.skipped, self.failed = (outcome == k for k in ("passed", "skipped", "failed"))
            self.outcome = outcome
            self.longreprtext = str(longrepr)

    path = tmp_path / "r.json"
    target = Native({"hf": print}, {"hf": {"accuracy": "dtype"}}, {"hf-glm": "ModuleNotFoundError: x"}, "hf")
    plugin = report.ConformanceReport(str(path), target, "cpu-interp")
    plugin.pytest_runtest_logreport(Rep("setup", "passed", [("rope_property", "hf: forward")]))
    plugin.pytest_runtest_logreport(Rep("call", "passed", [("rope_property", "hf: forward")]))
    plugin.pytest_runtest_logreport(Rep("teardown", "passed", []))  # no properties: known by nodeid, and passed
    plugin.pytest_sessionfinish(None)
    data = json.loads(path.read_text())
    assert data["impl"] == "hf" and data["profile"] == "cpu-interp"
    assert data["capabilities"] == {"hf": "yes (declares {'accuracy': 'dtype'})",
                                    "hf-glm": "not installed (ModuleNotFoundError: x)"}
    assert data["results"] == {"hf: forward": {"outcome": "pass"}}


def test_counterexample_is_trimmed():
    text = "\n".join(["    def test(): ...", "E       AssertionError: forward: 3 of 8 elements outside",
                      "E       Falsifying example: test(", "E           target=Native('hf'),",
                      "E           plan=Plan(dtype='bf16',", "E            s=2,", "E            seed=0),",
                      "E       )", "E       ", "E       You can reproduce this example by ..."])
    got = report.counterexample(text)
    assert got.splitlines()[0] == "AssertionError: forward: 3 of 8 elements outside"
    assert "Falsifying example: test(target=Native('hf'), plan=Plan(dtype='bf16', s=2, seed=0))" in got
    assert "reproduce" not in got


def test_counterexample_of_several_distinct_failures_keeps_each():
    """Hypothesis reports distinct failures as an exception group behind a gutter: every part keeps its message
    and example (none is an empty entry)."""
    text = "\n".join([
        "  + Exception Group Traceback (most recent call last):",
        "  | ExceptionGroup: Hypothesis found 2 distinct failures. (2 sub-exceptions)",
        "  +-+---------------- 1 ----------------", "    | Traceback (most recent call last):",
        "    | ValueError: big 51", "    | Falsifying example: test_x(", "    |     n=51,", "    | )",
        "    | Explanation:", "    |     These lines were always and only run by failing examples:",
        "    +---------------- 2 ----------------", "    | AssertionError: small 10", "    | assert 10 < 10",
        "    | Falsifying example: test_x(", "    |     n=10,", "    | )", "    +------------------------------------"])
    got = report.counterexample(text).splitlines()
    assert got == ["(1 of 2) ValueError: big 51", "Falsifying example: test_x(n=51)",
                   "(2 of 2) AssertionError: small 10", "Falsifying example: test_x(n=10)"], got


def test_merge_and_splice(tmp_path):
    runs = [{"impl": name, "profile": "gpu", "version": "x 1", "capabilities": {"hf": "yes"},
             "results": {"hf: forward": {"outcome": "pass"},
                         "hf: invariant inverse": {"outcome": "fail", "detail": "AssertionError: boom"}}}
            for name in ("hf", "liger")]
    text = report.render(runs, unavailable={"vllm": "not installed here; install it with: pip install vllm"})
    assert "| property | `hf` | `liger` | `vllm` |" in text
    assert "| hf: invariant inverse | **fail** | **fail** | not installed |" in text and "AssertionError: boom" in text
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    assert report.main(["hf:no_such_module_xyz:f", "--out", str(doc)]) == 0  # nothing to run: one column
    spliced = doc.read_text()
    assert spliced.startswith("intro\n") and spliced.endswith("after\n") and "old" not in spliced
    assert "### Conformance report" in spliced and "no_such_module_xyz" in spliced


