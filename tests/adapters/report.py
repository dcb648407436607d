"""The conformance report: implementation x property, from one pytest run (`--conformance-report PATH`).

Every test that runs the target (it uses the `target` fixture) is a property: conftest.py tags it with
`property_name(item)` (tests/test_mrope.py's `test_mrope_*`, on the target's mRoPE call, give the `mrope_*` rows).
This plugin, registered on the controller (it sees pytest-xdist workers' reports too), collects each property's
outcome:
    pass                      every example passed (with `narrowed` reasons when some fell outside the capabilities)
    fail                      with Hypothesis' shrunk counterexample ("Falsifying example: ...") and the message
    not supported             skipped, with the reason (a capability the implementation lacks)
    error                     the test could not run (setup or teardown failed)
and writes them as Markdown, or as JSON when PATH ends in .json (tests/adapters/conformance.py merges those).
"""
from __future__ import annotations

import json
import re
import textwrap
from typing import Optional

MAX_EXAMPLE_LINES = 14
MAX_MESSAGE_LINES = 4


def property_name(item) -> Optional[str]:
    """A test of the target -> its property name (the check's name), else None."""
    if "target" not in getattr(item, "fixturenames", ()):
        return None
    name = (getattr(item, "originalname", None) or item.name).removeprefix("test_")
    callspec = getattr(item, "callspec", None)
    if name == "rejects_bad_input" and callspec is not None and "rule" in callspec.params:
        return f"bad_input: {callspec.params['rule'].name}"
    if callspec is not None:
        return f"{name}[{callspec.id}]"
    return name


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
    reason = reason.removeprefix("Skipped: ")
    return re.sub(r"^not supported( by \S+)?: ", "", reason)


def version_of(spec: str) -> str:
    """The installed version of a named implementation's distribution ('' for other targets)."""
    from importlib import metadata

    from . import ALL_NAMES, convention_module, parse

    if spec not in ALL_NAMES:
        return ""
    dists = ("rope-triton",) if spec == "rope" else convention_module(parse(spec).convention).DISTS
    if isinstance(dists, dict):  # a convention of several named implementations: per name
        dists = dists.get(spec, ())
    for dist in dists:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return ""


def native_rows(target) -> dict:
    """The conventions the target is certified in natively (tests/conformance), with what it declares."""
    native = getattr(target, "native", None)
    if native is None:
        return {}
    rows = {}
    for conv in native.fns:
        declared = {k: v for k, v in native.caps.get(conv, {}).items()}
        rows[f"native {conv}"] = "yes" + (f" (declares {declared})" if declared else "")
    for conv, why in native.missing.items():
        rows[f"native {conv}"] = f"not installed ({why})"
    return rows


def capability_rows(target) -> dict:
    """The target's capability cells: TE's convention, then its multimodal RoPE's ("mRoPE ..." rows), then the
    native conventions ("native ..." rows)."""
    if target.fn is None:
        return native_rows(target)
    rows = {**target.caps.table(), **native_rows(target)}
    mrope_caps = getattr(target, "mrope_caps", None)
    if getattr(target, "mrope", None) is None or mrope_caps is None:
        rows["mRoPE"] = "none"
        return rows
    rows["mRoPE"] = f"yes ({mrope_caps.notes})" if mrope_caps.notes else "yes"
    rows.update({f"mRoPE {k}": v for k, v in mrope_caps.table().items()})
    return rows


class ConformanceReport:
    """pytest plugin: collects outcomes by property name, writes the table at the end of the session."""

    def __init__(self, path: str, target, profile: str = ""):
        self.path = path
        self.impl = target.name
        self.caps = capability_rows(target)
        self.convention = target.convention
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
            if props.get("rope_narrowed"):
                entry["narrowed"] = props["rope_narrowed"]
        elif report.failed:  # teardown
            entry.update(outcome="error", detail=counterexample(report.longreprtext))

    def data(self) -> dict:
        return {"impl": self.impl, "convention": self.convention, "profile": self.profile, "version": self.version,
                "capabilities": self.caps, "results": self.results}

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
        return "pass" + (" (narrowed)" if r.get("narrowed") else "")
    if outcome == "fail":
        return "**fail**"
    if outcome == "error":
        return "**error**"
    if outcome == "not supported":
        return "n/s: " + _md(r.get("reason", ""))
    return _md(outcome)


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _order(name: str):
    return (name.startswith("bad_input"), name.startswith("context_parallel_matches"), name)


def render(runs: list, title: str = "Conformance report", unavailable: Optional[dict] = None, level: int = 1) -> str:
    """Markdown: capabilities per implementation, the property table, then each failure's counterexample.
    `level`: the title's heading level (sections one below, failures two below)."""
    h1, h2, h3 = ("#" * n for n in (level, level + 1, level + 2))
    impls = [r["impl"] for r in runs] + list(unavailable or {})
    lines = [f"{h1} {title}", ""]
    profiles = sorted({r.get("profile", "") for r in runs} - {""})
    if profiles:
        lines += [f"Hypothesis profile: {', '.join(profiles)}. Cells: pass; **fail** (counterexample below); "
                  "n/s: not supported, with the reason; pass (narrowed): examples outside the capabilities were "
                  "rejected, the rest passed (reasons below).", ""]
    if unavailable:
        lines += ["Not installed here: " + "; ".join(f"`{k}`: {_md(v)}" for k, v in unavailable.items()), ""]
    if runs:
        rows = list(dict.fromkeys(row for r in runs for row in r["capabilities"]))  # every run's, in order
        lines += [f"{h2} Capabilities", "", "| capability | " + " | ".join(f"`{r['impl']}`" for r in runs) + " |",
                  "|---|" + "---|" * len(runs)]
        lines.append("| version | " + " | ".join(_md(r.get("version") or "-") for r in runs) + " |")
        for row in rows:
            lines.append(f"| {row} | " + " | ".join(_md(r["capabilities"].get(row, "-")) for r in runs) + " |")
        lines.append("")
    names = sorted({n for r in runs for n in r["results"]}, key=_order)
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
    narrowed = [(r["impl"], n, r["results"][n]["narrowed"]) for r in runs for n in names
                if r["results"].get(n, {}).get("narrowed")]
    if narrowed:
        lines += [f"{h2} Examples outside the capabilities (rejected, not counted)", ""]
        for impl, n, reasons in narrowed:
            why = "; ".join(f"{k} ({v})" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
            lines.append(f"- `{impl}` {_md(n)}: {_md(why)}")
        lines.append("")
    return "\n".join(lines)
