"""Mutation testing of rope/ against a reduced, fast selection of the CPU suite (cosmic-ray), a score per file.

    python -m tests.mutation [rope/FILE.py ...] [--out mutation.md] [--tests "PYTEST ARGS"] [--jobs N]

(`tox -e mutation` runs it on every file of rope/.) The working tree is copied to a temporary directory first:
cosmic-ray rewrites the file under test in place, and that must never happen in a tree someone edits. For each
file one cosmic-ray session is made (`init`, then `exec`) with the test command below; a mutant is killed when the
tests fail (or time out), survives when they pass, and is incompetent when it cannot even be imported. The score
of a file is killed / (killed + survived). The report lists the scores and every survivor (operator, line, diff).

The test selection per file is a small, quick part of the CPU suite that exercises it (a few Hypothesis
examples, ROPE_MAX_EXAMPLES): the whole suite takes minutes, and a campaign runs it once per mutant.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = "python -m pytest -x -q -n 0 -p no:cacheprovider"
FAST = "tests/test_suite_catches_bugs.py::test_perturbed_reference_without_hooks_is_the_reference"
# file -> the tests that exercise it, fast (the kernel ones run Triton's interpreter: slower, fewer examples)
SELECTION = {
    "rope/reference.py": f"tests/test_reference_meta.py {FAST}",
    "rope/_table.py": "tests/test_angle_table.py tests/test_position_table.py",
    "rope/embedding.py": "tests/test_core.py -k 'embedding or Embedding'",
    "rope/_validate.py": "tests/test_bad_input.py tests/test_core.py",
    "rope/functional.py": "tests/test_core.py tests/test_qk_inplace.py",
    "rope/_launch.py": "tests/test_core.py tests/test_properties.py::test_matches_float64_reference",
    "rope/_kernel.py": "tests/test_core.py tests/test_properties.py::test_matches_float64_reference",
    "rope/_ops.py": "tests/test_compile.py",
}
DEFAULT_TESTS = "tests/test_core.py tests/test_properties.py::test_matches_float64_reference"
CONFIG = """[cosmic-ray]
module-path = "{module}"
timeout = {timeout}
excluded-modules = []
test-command = "{command}"

[cosmic-ray.distributor]
name = "local"
"""


def copy_tree(dst: Path):
    """The files git knows here (tracked, and untracked but not ignored): the tree as it is, without .venv."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def cosmic_ray(*args, cwd, timeout=None) -> bool:
    """Run a cosmic-ray command; False when it was stopped at `timeout` seconds (its process group ended)."""
    proc = subprocess.Popen([sys.executable, "-m", "cosmic_ray.cli", *args], cwd=cwd, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # exec and the test run it started, nothing else
        proc.wait()
        return False
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return True


def mutate_file(work: Path, module: str, tests: str, timeout: float, max_examples: int,
                budget_s: float | None = None) -> dict:
    """One cosmic-ray session; with budget_s, exec stops then (cosmic-ray takes the mutants in random order, so
    the finished ones are a random sample: the result is partial, with the pending count)."""
    env_prefix = f"env ROPE_MAX_EXAMPLES={max_examples} PYTHONDONTWRITEBYTECODE=1 "
    cfg = work / f"cr-{Path(module).stem}.toml"
    cfg.write_text(CONFIG.format(module=module, timeout=timeout, command=env_prefix + f"{PYTEST} {tests}"))
    session = work / f"cr-{Path(module).stem}.sqlite"
    cosmic_ray("init", str(cfg), str(session), cwd=work)
    cosmic_ray("exec", str(cfg), str(session), cwd=work, timeout=budget_s)
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    counts = {"killed": 0, "survived": 0, "incompetent": 0}
    survivors = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            outcome = result.test_outcome or TestOutcome.INCOMPETENT
            counts[TestOutcome(outcome).value] += 1
            if outcome == TestOutcome.SURVIVED:
                m = item.mutations[0]
                survivors.append((m.start_pos[0], m.operator_name, (result.diff or "").strip()))
        pending = sum(1 for _ in db.pending_work_items)
    decided = counts["killed"] + counts["survived"]
    return {"file": module, "tests": tests, **counts, "pending": pending,
            "score": counts["killed"] / decided if decided else float("nan"), "survivors": sorted(survivors)}


def render(results: list, max_examples: int) -> str:
    lines = ["| file | mutants run | killed | survived | incompetent | score | tests |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        n = r["killed"] + r["survived"] + r["incompetent"]
        run = f"{n} of {n + r['pending']} (partial: a random sample)" if r["pending"] else str(n)
        lines.append(f"| `{r['file']}` | {run} | {r['killed']} | {r['survived']} | {r['incompetent']} | "
                     f"{r['score']:.1%} | `{r['tests']}` (ROPE_MAX_EXAMPLES={max_examples}) |")
    for r in results:
        if r["survivors"]:
            lines += ["", f"Survivors in `{r['file']}`:", ""]
            for line, op, diff in r["survivors"]:
                body = "\n".join(ln for ln in diff.splitlines() if ln.startswith(("+", "-"))
                                 and not ln.startswith(("+++", "---")))
                lines += [f"- line {line}, {op}:", "", "  ```diff", *("  " + ln for ln in body.splitlines()),
                          "  ```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", default=sorted(SELECTION), help="files of rope/ (default: all)")
    parser.add_argument("--tests", default=None, help="pytest arguments for every file (default: SELECTION)")
    parser.add_argument("--out", default="mutation.md")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run")
    parser.add_argument("--max-examples", type=int, default=5, help="Hypothesis examples per property")
    parser.add_argument("--minutes", type=float, default=None,
                        help="stop each file's campaign after this long and report the mutants done (partial)")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="rope-mutation-") as tmp:
        work = Path(tmp)
        copy_tree(work)
        for module in args.files:
            tests = args.tests or SELECTION.get(module, DEFAULT_TESTS)
            budget = None if args.minutes is None else 60 * args.minutes
            results.append(mutate_file(work, module, tests, args.timeout, args.max_examples, budget))
            print(f"{module}: score {results[-1]['score']:.1%}", flush=True)
    Path(args.out).write_text(render(results, args.max_examples))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
