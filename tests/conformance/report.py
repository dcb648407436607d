"""The conformance report: implementation x property, from pytest runs of the native suite.

    pytest --rope-impl IMPL tests/conformance/test_native.py --conformance-report PATH      one implementation
    python -m tests.conformance.report [IMPL ...] [--out docs/conformance.md] [-- PYTEST ARGS]   several, merged

Every test of the target (it uses the `target` fixture: test_native.py's forward, backward and invariants, one per
convention) is a property: conftest.py tags it with `property_name(item)`, e.g. "hf: forward" or
"hf: invariant inverse". The plugin here, registered on the controller (it sees pytest-xdist workers' reports too),
collects each property's outcome:
    pass                      every example passed
    fail                      with Hypothesis' shrunk counterexample ("Falsifying example: ...") and the message
    not supported             skipped, with the reason (a convention the implementation lacks, or one it declares off)
    error                     the test could not run (setup or teardown failed)
and writes them as Markdown, or as JSON when PATH ends in .json. `main` runs pytest once per implementation that is
installed and merges the tables; one that is not installed gets a column saying how to install it. When --out names
an existing file holding the markers `<!-- conformance:begin -->` and `<!-- conformance:end -->`, only the text
between them is replaced (docs/conformance.md keeps its prose); otherwise the file is the report.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Optional

MAX_EXAMPLE_LINES = 14
MAX_MESSAGE_LINES = 4
ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/conformance/test_native.py"]
BEGIN, END = "<!-- conformance:begin -->", "<!-- conformance:end -->"


def property_name(item) -> Optional[str]:
    """A test of the target -> its property name ("CONVENTION: property"), else None."""
    if "target" not in getattr(item, "fixturenames", ()):
        return None
    name = (getattr(item, "originalname", None) or item.name).removeprefix("test_")
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "name" in params:
        invariant = params.get("invariant")
        return f"{params['name']}: {name}" + (f" {invariant}" if invariant else "")
    callspec = getattr(item, "callspec", None)
    return f"{name}[{callspec.id}]" if callspec is not None else name


_EXAMPLE = re.compile(r"\s*(Falsifying (explicit )?example|Failing test case)\b")


def _one_counterexample(text: str) -> str:
    """Hypothesis' shrunk example ("Falsifying example: ..." / "Failing test case: ...") on one wrapped
    paragraph, and the assertion's message: the failure in a few lines."""
    lines = [re.sub(r"^E {1,7}", "", ln) for ln in text.splitlines()]
    example = []
    for i, ln in enumerate(lines):
        if _EXAMPLE.match(ln):
            block = [ln.strip()]
            for nxt in lines[i + 1:]:
                if not nxt.strip() or re.match(r"\s*([-=+]{3,}|Explanation:)", nxt):
                    break
                block.append(nxt.strip())
            flat = re.sub(r"\(\s+", "(", " ".join(block))
            flat = re.sub(r",\s+\)", ")", flat)  # a trailing comma before a closing line, not (x,)
            example = textwrap.wrap(flat, 116, break_on_hyphens=False)[:MAX_EXAMPLE_LINES]
            break
    errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")] or \
        [ln.strip() for ln in text.splitlines() if re.match(r"\w*(Error|Exception)\b", ln.strip())][-1:]
    message = [e for e in errors if re.match(r"\w*(Error|Exception|Unsatisfiable)\b", e)][:1] or errors[:1]
    if not message and "crashed" in text:  # pytest-xdist: the worker died (a segfault, an abort)
        message = [ln.strip() for ln in text.splitlines() if "crashed" in ln][:1]
    tail = [m[:400] for m in message[:MAX_MESSAGE_LINES]]
    if example or tail:
        return "\n".join(tail + example)
    last = text.strip().splitlines()
    return last[-1][:400] if last else ""


_GROUP_PART = re.compile(r"^\s*\+?-[-+]*-* \d+ -+$", re.M)
_GUTTER = re.compile(r"^\s*[|+] ?", re.M)


def counterexample(text: str) -> str:
    """The failure in a few lines. Hypothesis reports several distinct failures as an exception group, whose
    parts are printed behind a "|" gutter: each part's message and example, numbered, so that none is lost."""
    if "Exception Group" not in text and "ExceptionGroup" not in text:
        return _one_counterexample(text)
    parts = _GROUP_PART.split(text)[1:]
    found = [_one_counterexample(_GUTTER.sub("", part)) for part in parts]
    found = [f for f in found if f]
    if not found:
        return _one_counterexample(_GUTTER.sub("", text))
    return "\n".join(f"({i} of {len(found)}) {f}" for i, f in enumerate(found, 1))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def version_of(name: str) -> str:
    """The installed version of a named implementation's distribution ('' for other targets)."""
    from importlib import metadata

    from .registry import DISTRIBUTIONS

    for dist in DISTRIBUTIONS.get(name, ((), ""))[0]:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return ""


def capability_rows(target) -> dict:
    """The conventions the target has (with what it declares), and those of a named implementation that are not
    installed here."""
    rows = {}
    for conv in target.fns:
        declared = dict(target.caps.get(conv, {}))
        rows[conv] = "yes" + (f" (declares {declared})" if declared else "")
    for conv, why in target.missing.items():
        rows[conv] = f"not installed ({why})"
    return rows


class ConformanceReport:
    """pytest plugin: collects outcomes by property name, writes the table at the end of the session."""

    def __init__(self, path: str, target, profile: str = ""):
        self.path = path
        self.impl = target.name
        self.caps = capability_rows(target)
        self.profile = profile
        self.version = version_of(target.name)
        self.results: dict = {}
        self.names: dict = {}  # nodeid -> property name

    def pytest_runtest_logreport(self, report):
        props = dict(report.user_properties)
        # a crashed pytest-xdist worker's report carries no user properties: known from the earlier phase
        name = props.get("rope_property") or self.names.get(report.nodeid)
        if name is None:
            return
        self.names[report.nodeid] = name
        entry = self.results.setdefault(name, {"outcome": "not run"})
        if report.when == "setup":
            if report.skipped:
                entry.update(outcome="not supported", reason=_skip_reason(report))
            elif report.failed:
                entry.update(outcome="error", detail=counterexample(report.longreprtext))
        elif report.when == "call":
            if report.passed:
                entry["outcome"] = "pass"
            elif report.skipped:
                entry.update(outcome="not supported", reason=_skip_reason(report))
            else:
                entry.update(outcome="fail", detail=counterexample(report.longreprtext))
        elif report.failed:  # teardown
            entry.update(outcome="error", detail=counterexample(report.longreprtext))

    def data(self) -> dict:
        return {"impl": self.impl, "profile": self.profile, "version": self.version, "capabilities": self.caps,
                "results": self.results}

    def pytest_sessionfinish(self, session):
        text = json.dumps(self.data(), indent=1) if self.path.endswith(".json") else render([self.data()])
        with open(self.path, "w") as f:
            f.write(text)

    def pytest_terminal_summary(self, terminalreporter):
        counts: dict = {}
        for r in self.results.values():
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        terminalreporter.write_line(f"conformance report ({self.impl}: {summary}) written to {self.path}")


# ----------------------------------------------------------------------------------------------
# Rendering (one run or several merged)
# ----------------------------------------------------------------------------------------------

def _cell(r: Optional[dict]) -> str:
    if r is None:
        return "-"
    outcome = r["outcome"]
    if outcome == "pass":
        return "pass"
    if outcome == "fail":
        return "**fail**"
    if outcome == "error":
        return "**error**"
    if outcome == "not supported":
        return "n/s: " + _md(r.get("reason", ""))
    return _md(outcome)


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render(runs: list, title: str = "Conformance report", unavailable: Optional[dict] = None, level: int = 1) -> str:
    """Markdown: the conventions of each implementation (with what it declares), the property table, then each
    failure's counterexample.
    `level`: the title's heading level (sections one below, failures two below)."""
    h1, h2, h3 = ("#" * n for n in (level, level + 1, level + 2))
    impls = [r["impl"] for r in runs] + list(unavailable or {})
    lines = [f"{h1} {title}", ""]
    profiles = sorted({r.get("profile", "") for r in runs} - {""})
    if profiles:
        lines += [f"Hypothesis profile: {', '.join(profiles)}. Cells: pass; **fail** (counterexample below); "
                  "n/s: not supported, with the reason.", ""]
    if unavailable:
        lines += ["Not installed here: " + "; ".join(f"`{k}`: {_md(v)}" for k, v in unavailable.items()), ""]
    if runs:
        rows = list(dict.fromkeys(row for r in runs for row in r["capabilities"]))  # every run's, in order
        lines += [f"{h2} Conventions", "", "| convention | " + " | ".join(f"`{r['impl']}`" for r in runs) + " |",
                  "|---|" + "---|" * len(runs)]
        lines.append("| version | " + " | ".join(_md(r.get("version") or "-") for r in runs) + " |")
        for row in rows:
            lines.append(f"| {row} | " + " | ".join(_md(r["capabilities"].get(row, "-")) for r in runs) + " |")
        lines.append("")
    names = sorted({n for r in runs for n in r["results"]})
    lines += [f"{h2} Properties", "", "| property | " + " | ".join(f"`{i}`" for i in impls) + " |",
              "|---|" + "---|" * len(impls)]
    for n in names:
        cells = [_cell(r["results"].get(n)) for r in runs] + ["not installed"] * len(unavailable or {})
        lines.append(f"| {_md(n)} | " + " | ".join(cells) + " |")
    lines.append("")
    failures = [(r["impl"], n, r["results"][n]) for r in runs for n in names
                if r["results"].get(n, {}).get("outcome") in ("fail", "error", "not run")]
    if failures:
        lines += [f"{h2} Failures", ""]
        for impl, n, res in failures:
            lines += [f"{h3} `{impl}`: {n}", "", "```", (res.get("detail") or res["outcome"]).strip(), "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Several implementations, merged
# ----------------------------------------------------------------------------------------------

def availability(spec: str):
    """None when `spec` resolves to at least one convention here, else the one-line reason."""
    from .registry import DISTRIBUTIONS, resolve

    try:
        target = resolve(spec)
    except Exception as e:  # noqa: BLE001 - reported in the table, the other implementations still run
        return f"cannot load: {type(e).__name__}: {e}"
    if target.fns:
        return None
    if target.missing:
        install = DISTRIBUTIONS.get(spec, ((), ""))[1]
        return f"not installed here; install it with: {install}" if install else "not installed here"
    return "no convention of the native suite"


def run_one(spec: str, pytest_args: list, workdir: str) -> dict:
    out = os.path.join(workdir, f"{len(os.listdir(workdir))}.json")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rope-impl={spec}",
           f"--conformance-report={out}", *(pytest_args or FILES)]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT)
    if not os.path.exists(out):
        raise RuntimeError(f"{spec}: pytest exited with {proc.returncode} and wrote no report")
    with open(out) as f:
        return json.load(f)


def splice(path: Path, body: str) -> str:
    """The file's text with the marked section replaced by body (or body alone)."""
    if path.exists():
        text = path.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            return f"{head}{BEGIN}\n{body}\n{END}{tail}"
    return body


def main(argv=None) -> int:
    from .registry import NAMED

    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m tests.conformance.report", description=__doc__.split("\n")[0])
    parser.add_argument("impls", nargs="*", default=list(NAMED),
                        help="--rope-impl values (default: every named implementation)")
    parser.add_argument("--out", default="conformance.md", help="Markdown file to write (default: conformance.md)")
    parser.add_argument("--title", default="Conformance report")
    args = parser.parse_args(argv)
    runs, unavailable = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.impls:
            why = availability(spec)
            if why is not None:
                print(f"{spec}: skipped: {why}", flush=True)
                unavailable[spec] = why
                continue
            runs.append(run_one(spec, pytest_args, tmp))
    out = Path(args.out)
    spliced = out.exists() and BEGIN in out.read_text()
    out.write_text(splice(out, render(runs, title=args.title, unavailable=unavailable, level=3 if spliced else 1)))
    print(f"wrote {out} ({len(runs)} run, {len(unavailable)} not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
