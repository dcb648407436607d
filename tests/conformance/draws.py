"""Draws that depend on nothing but the seed.

Hypothesis mixes into its draws constants found in the project's modules loaded so far (sys.modules), so a
derandomized run would depend on which tests ran before in the process (under pytest-xdist, on which worker it
lands). The zoo's verdicts and the domain-coverage proof must not: within `no_local_constants()` that pool is
empty (where Hypothesis has it).
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def no_local_constants():
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - another Hypothesis layout: its draws as they are
        yield
        return
    if not hasattr(providers, "_get_local_constants"):
        yield
        return
    saved = providers._get_local_constants
    providers._get_local_constants = lambda: providers.Constants()
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = saved
        providers.CONSTANTS_CACHE.cache.clear()
