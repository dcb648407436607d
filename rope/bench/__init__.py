"""Benchmarks of `rope` against the copy bandwidth and the other RoPE implementations.

`python -m rope.bench --help` for the command-line report; `benchmarks/` holds the
pytest-benchmark suite. Modules: shapes (the cases), inputs (random inputs), peers (one adapter
per implementation), checks (float64 check before timing), timing (GPU and host timers, copy
bandwidth), runner (one run), report (table, targets, JSON, plots), machine (device and versions),
progress (progress bar).
"""
