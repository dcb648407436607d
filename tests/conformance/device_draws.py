"""Every planted bug of the zoo under the device's draws, on the CPU.

    python -m tests.conformance.device_draws [CONVENTION ...]

On a GPU the plan strategies draw device-sized cases (`spec.small()` is False); on the CPU the interpreter's small
ones. A planted bug caught by one set of draws may pass the other, and `test_zoo.py` on a CPU sees only the small
ones. This runs `test_zoo.falsify` for every (bug, property) pair with the device's draws, in this process on the
CPU (the zoo's implementations are PyTorch), with the examples `test_zoo.catch_budget` gives them on a device,
and exits 1 if any passes or crashes instead of failing a check.
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
    names = (sys.argv[1:] if argv is None else argv)
    import conftest  # noqa: F401 - the suite's Hypothesis profiles, whose gpu count `catch_budget` gives
    device_draws()
    from . import test_zoo
    missed = 0
    for name, zoo in test_zoo.zoo_modules().items():
        if names and name not in names:
            continue
        for bug, (fn, props) in zoo.BUGS.items():
            for prop in props:
                t0 = time.perf_counter()
                failure = test_zoo.falsify(name, prop, fn, max_examples=test_zoo.catch_budget(prop))
                caught = isinstance(failure, AssertionError)
                missed += not caught
                verdict = "caught" if caught else "PASSED" if failure is None else f"crashed ({type(failure).__name__})"
                print(f"{verdict:10s} {name} {bug} {prop} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{missed} planted bug(s) not caught" if missed else "every planted bug caught")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
