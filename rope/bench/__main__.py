"""`python -m rope.bench`: measure the copy bandwidth, then every implementation on every case.

On a GPU: checks each implementation against float64, times forward and backward in CUDA graphs,
host cost per eager call for the small cases, prints a table and the issue's targets, writes
results.json, table.md and the sequence-length plots to --out.

On a CPU-only machine only --smoke runs: tiny cases through Triton's interpreter with host
clocks, to check the harness end to end (its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path


def _names(text):
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def parse_args(argv):
    from .peers import IMPL_NAMES

    p = argparse.ArgumentParser(prog="python -m rope.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a subset: the headline shape, a small one, decode, the thd/bshd pair, two sweep points, "
                        "the Llama GQA q/k case and the in-place case")
    p.add_argument("--smoke", action="store_true",
                   help="tiny cases, minimal repetitions; on a CPU-only machine through Triton's interpreter")
    p.add_argument("--shapes", type=_names, metavar="NAME,...", help="run these cases (see --list)")
    p.add_argument("--impls", type=_names, metavar="NAME,...",
                   help=f"run these implementations (default: all of {','.join(IMPL_NAMES)}; missing ones are "
                        "reported as skipped)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default: bench-out/)")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list cases and implementations, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _list():
    from .peers import IMPL_NAMES
    from .shapes import CASES, SMOKE_CASES

    print("cases (q: in --quick, s: in --smoke):")
    for c in CASES + SMOKE_CASES:
        flag = "q" if "quick" in c.tags else "s" if c in SMOKE_CASES else " "
        print(f"  {flag} {c.name:<22} {c.fmt} {c.dtype:<4} {c.label:<48} {c.bytes_fwd / 1e6:9.2f} MB/call")
    print("case kinds: one tensor (ours, ours_graph, ours_compiled, reference, compile, te, flash, liger); "
          "q and k (ours_qk, ours_2x; ours_compiled, reference and compile as two calls); "
          "in place (ours_inplace, forward only)")
    print("implementations: " + ", ".join(IMPL_NAMES))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.list:
        _list()
        return 0

    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            print("rope.bench: no CUDA device. Timing Triton's CPU interpreter would measure nothing; "
                  "use --smoke to check the harness end to end.", file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET") != "1":
            # Triton reads TRITON_INTERPRET when it is imported, and `import rope` (which runs
            # before this module) already imported it: start again with the interpreter on.
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, "-m", "rope.bench", *argv], env)

    from . import report
    from .peers import OURS, make_impls
    from .runner import run
    from .shapes import select
    from .timing import SMOKE_BUDGET, Budget

    try:
        cases = select(args.shapes, quick=args.quick, smoke=args.smoke)
        # On CPU, inductor would need a C++ toolchain and minutes; aot_eager still runs dynamo and
        # AOTAutograd, which is what the smoke run checks.
        impls = make_impls(args.impls, compile_backend="inductor" if cuda else "aot_eager")
    except ValueError as exc:
        print(f"rope.bench: {exc}", file=sys.stderr)
        return 2
    budget = SMOKE_BUDGET if args.smoke else Budget()
    device = "cuda" if cuda else "cpu"

    results = run(cases, impls, device, budget, seed=args.seed, show_progress=not args.no_progress)
    results["meta"]["command"] = "python -m rope.bench" + (" " + shlex.join(argv) if argv else "")
    results["meta"]["mode"] = "smoke" if args.smoke else "quick" if args.quick else "full"
    targets = report.evaluate_targets(results)
    results["targets"] = targets

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    table = report.markdown_table(results)
    header = report.header_text(results)
    (out / "table.md").write_text(f"{header}\n\n{table}\n\n```\n{report.targets_text(targets)}\n```\n")
    report.write_json(results, out / "results.json")
    written = [out / "results.json", out / "table.md"]
    if not args.no_plots:
        try:
            written += report.plot_sweep(results, out)
        except ImportError:
            print("rope.bench: matplotlib is not installed; no plots written", file=sys.stderr)

    print(header)
    print()
    print(table)
    print()
    print(report.targets_text(targets))
    print()
    print("wrote " + ", ".join(str(p) for p in written))
    bad = [r for r in results["results"] if r["impl"] in OURS and r["status"] in ("check_failed", "error")]
    for r in bad:
        print(f"rope.bench: {r['impl']} {r['status']} on {r['case']}: {r['reason']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
