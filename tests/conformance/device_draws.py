"""Every planted bug of the zoo under the device's draws, on the CPU.

    python -m tests.conformance.device_draws [CONVENTION ...]
    python -m tests.conformance.device_draws --seeds 20 [CONVENTION ...]   # catch rates over 20 random seeds

On a GPU the plan strategies draw device-sized cases (`spec.small()` is False); on the CPU the interpreter's small
ones. A planted bug caught by one set of draws may pass the other, and `test_zoo.py` on a CPU sees only the small
ones. This runs `test_zoo.falsify` for every (bug, property) pair with the device's draws, in this process on the
CPU (the zoo's implementations are PyTorch), with the examples `test_zoo.catch_budget` gives them on a device,
and exits 1 if any passes or crashes instead of failing a check. Each line names the example that caught the bug
(of the budget): what a property needs on the device, for the known bugs. With --seeds N each (bug, property) runs
on N other seeds' draws too (a certifying run's draws are random, not these derandomized ones) and the line gives
how many of them caught it (and at which example each), on how many the bug raised an error of its own first (a
failed run too, but no verdict of the property's), and on how many it PASSED: a property that passes a planted bug
on some seeds certifies a kernel with that bug by chance, and counts as a miss.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import time

from . import spec


def device_draws() -> None:
    """Make every plan strategy draw the device's shapes (in this process)."""
    for info in pkgutil.iter_modules(spec.__path__):
        module = importlib.import_module(f"{spec.__name__}.{info.name}")
        if hasattr(module, "small"):
            module.small = lambda: False
    spec.small = lambda: False


def main(argv=None) -> int:
    names = list(sys.argv[1:] if argv is None else argv)
    seeds = 0
    if "--seeds" in names:
        at = names.index("--seeds")
        seeds = int(names[at + 1])
        del names[at:at + 2]
    import conftest  # noqa: F401 - the suite's Hypothesis profiles, whose gpu count `catch_budget` gives
    device_draws()
    from . import test_zoo
    missed = 0
    for name, zoo in test_zoo.zoo_modules().items():
        if names and name not in names:
            continue
        for bug, (fn, props) in zoo.BUGS.items():
            for prop in props:
                t0, drawn = time.perf_counter(), []
                budget = test_zoo.catch_budget(name, prop, bug)
                failure = test_zoo.falsify(name, prop, fn, max_examples=budget, drawn=drawn)
                caught = isinstance(failure, AssertionError)
                verdict = "caught" if caught else "PASSED" if failure is None else f"crashed ({type(failure).__name__})"
                rate, passed = "", 0
                if seeds:
                    verdicts, at = [], []
                    for s in range(seeds):
                        seen = []
                        verdicts.append(test_zoo.falsify(name, prop, fn, max_examples=budget, drawn=seen,
                                                         draws_seed=s))
                        if isinstance(verdicts[-1], AssertionError):
                            at.append(len(seen))
                    hits = sum(isinstance(v, AssertionError) for v in verdicts)
                    passed = sum(v is None for v in verdicts)
                    rate = (f", caught on {hits} of {seeds} seeds (at examples {sorted(at)}), the target raised "
                            f"first on {seeds - hits - passed}, PASSED on {passed}")
                missed += not caught or passed > 0  # one miss per (bug, property)
                print(f"{verdict:10s} {name} {bug} {prop} (example {len(drawn)} of {budget}{rate}, "
                      f"{time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{missed} planted bug(s) not caught" if missed else "every planted bug caught")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
