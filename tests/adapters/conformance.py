"""Run the suite once per installed implementation and merge the conformance tables.

    python -m tests.adapters.conformance [IMPL ...] [--out docs/conformance.md] [-- PYTEST ARGS]

IMPL: named implementations or any --rope-impl value (default: DEFAULT_IMPLS: the named ones, multimodal RoPE's
included, and this package's functions in each convention). Each one that is installed runs
`pytest --rope-impl IMPL --conformance-report <tmp>.json` (a subprocess, the property files only: tests/test_mrope.py
gives the mrope_* rows) and the tables are merged; one that is not installed gets a column saying how to install
it. When --out names an
existing file holding the markers `<!-- conformance:begin -->` and `<!-- conformance:end -->`, only the text
between them is replaced (docs/conformance.md keeps its prose); otherwise the file is the report.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import MROPE_NAMES, NAMES, Unavailable, load
from .report import render

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/test_properties.py", "tests/test_invariants.py", "tests/test_bad_input.py",
         "tests/test_context_parallel_dist.py", "tests/test_mrope.py", "tests/conformance/test_native.py"]
# This package's own entry points behind each convention's adapter: the adapters' conversions checked by the suite.
OURS_IN_CONVENTIONS = ("hf:rope.hf:apply_rotary_pos_emb", "flash:rope.flash:apply_rotary_emb",
                       "vllm:rope.vllm:rotary_embedding", "hf-mrope:rope.hf:apply_multimodal_rotary_pos_emb",
                       "vllm-mrope:rope.vllm:mrotary_embedding")
DEFAULT_IMPLS = (*NAMES, *MROPE_NAMES, *OURS_IN_CONVENTIONS)
BEGIN, END = "<!-- conformance:begin -->", "<!-- conformance:end -->"


def availability(spec: str):
    """None when `spec` loads here, else the one-line reason (install command)."""
    try:
        load(spec)
    except Unavailable as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported in the table, the other implementations still run
        return f"cannot load: {type(e).__name__}: {e}"
    return None


def run_one(spec: str, pytest_args: list, workdir: str) -> dict:
    out = os.path.join(workdir, f"{len(os.listdir(workdir))}.json")
    files = [f for f in FILES if (ROOT / f).exists()]  # a checkout without one of them still reports the rest
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rope-impl={spec}",
           f"--conformance-report={out}", *(pytest_args or files)]
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
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m tests.adapters.conformance", description=__doc__.split("\n")[0])
    parser.add_argument("impls", nargs="*", default=list(DEFAULT_IMPLS),
                        help="--rope-impl values (default: all named, and this package's functions in each convention)")
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
