"""Stress run: threads x CUDA streams x drawn calls of every convention an implementation has, each call checked
as the native properties check it (run.forward, run.backward: the float64 oracle and the side-effect contract).

    python -m tests.conformance.stress [--impl rope] [--calls 3000] [--distinct 64] [--threads 8] [--seconds S]
                                       [--processes P] [--json PATH]

The calls are drawn first (each convention's own strategy, its capabilities as declared), then shuffled and
run by `--threads` threads, each on a CUDA stream of its own (on a CPU, the current stream): the launcher's
caches, the tables and the plans are shared by all of them while they run. Reports per convention the calls,
the wrong results (a check failed: must be 0), the errors (anything else raised) and the device memory held
before and after (growth: what the caches kept). `--seconds`: no call starts after that time, so that a run
under a time limit still reports (the calls not run are counted as such). `--processes`: P processes share the
device, each drawing and checking calls/P of its own (seeds seed, seed + 1, ...; the checks run on the host, under
one interpreter lock per process), and the report sums them (memory: the largest growth of any one). Exit status 1
if any call was wrong or raised. Under Triton's interpreter (TRITON_INTERPRET=1), which is not thread-safe, more than
one thread is refused for an implementation that launches Triton kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import hypothesis
import torch

from . import registry, run, spec


def _plans(strategy, n: int, seed: int) -> list:
    """n plans drawn by Hypothesis from `seed` (the same seed gives the same plans: a run is reproducible, and a
    planted bug's verdict does not depend on luck)."""
    plans: list = []

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=max(n, 1), database=None, deadline=None, phases=[hypothesis.Phase.generate],
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(strategy)
    def collect(plan):
        plans.append(plan)

    collect()
    return plans[:n]


def draw_jobs(native, calls: int, seed: int, distinct: int = 64) -> list:
    """(convention, property, plan) triples, `calls` in all, spread evenly over the conventions. Each convention's
    plans come from a pool of `distinct` drawn ones (drawing is slow, and every new shape compiles), each call with a
    seed of its own: new values in the shapes the pool holds."""
    names = list(native.fns)
    rnd = random.Random(seed)
    pools = {}
    for name in names:
        conv = spec.load(name)
        caps = conv.caps(native.caps.get(name))
        pools[name] = _plans(conv.plans(caps), min(distinct, -(-calls // len(names))), seed)
    jobs = []
    for i in range(calls):
        name = names[i % len(names)]
        conv = spec.load(name)
        caps = conv.caps(native.caps.get(name))
        prop = "backward" if conv.DIFFERENTIABLE and caps.get("backward", True) and rnd.random() < 0.3 else "forward"
        plan = rnd.choice(pools[name])
        if "seed" in getattr(plan, "_fields", ()):
            plan = plan._replace(seed=rnd.randrange(2**31))
        jobs.append((name, prop, plan))
    rnd.shuffle(jobs)
    return jobs


def interpreted_packages(native) -> list:
    """The packages of the implementation's functions that hold Triton kernels, when Triton's interpreter runs them
    (TRITON_INTERPRET=1): it keeps per-launch state in globals, so two threads launching at once read each other's
    values (wrong results, then a crash). Empty when kernels compile, or the implementation has none."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return []
    from triton.runtime.jit import KernelInterface

    found = []
    for fn in native.fns.values():
        fn = inspect.unwrap(getattr(fn, "func", fn))
        module = getattr(fn, "__module__", None) or ""
        package = module.rpartition(".")[0] or module
        for name, mod in list(sys.modules.items()):
            if (name == package or name.startswith(package + ".")) and package not in found and any(
                    isinstance(obj, KernelInterface) and getattr(getattr(obj, "fn", None), "__module__", "") == name
                    for obj in list(vars(mod).values())):
                found.append(package)
    return found


def refuse_interpreted_threads(native, threads: int) -> None:
    """Exit with a message, before any call runs, where threads would launch kernels in Triton's interpreter."""
    interpreted = interpreted_packages(native)
    if threads > 1 and interpreted:
        raise SystemExit(f"--threads {threads}: Triton's interpreter (TRITON_INTERPRET=1) is not thread-safe, and "
                         f"{', '.join(interpreted)} launches Triton kernels: concurrent launches would give wrong "
                         f"results, then crash. Run with --threads 1 (or --processes P), or on a GPU.")


def memory() -> int:
    if not torch.cuda.is_available():
        return 0
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def stress(impl: str, calls: int, threads: int, seed: int = 0, seconds: float = float("inf"),
           distinct: int = 64) -> dict:
    native = registry.resolve(impl)
    if not native.fns:
        raise SystemExit(f"--impl {impl}: no native convention")
    refuse_interpreted_threads(native, threads)
    jobs = draw_jobs(native, calls, seed, distinct)
    work: queue.Queue = queue.Queue()
    for job in jobs:
        work.put(job)
    counts = {name: Counter() for name in native.fns}
    failures: list = []
    lock = threading.Lock()

    def worker():
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while time.perf_counter() - start < seconds:
                try:
                    name, prop, plan = work.get_nowait()
                except queue.Empty:
                    return
                conv = spec.load(name)
                caps = conv.caps(native.caps.get(name))
                try:
                    getattr(run, prop)(conv, native.fns[name], caps, plan)
                    verdict = "ok"
                except AssertionError as e:
                    verdict = "wrong"
                    with lock:
                        failures.append(f"{name} {prop}: {str(e).splitlines()[0][:300]} :: {plan}")
                except Exception as e:  # noqa: BLE001 - counted and reported: the run must show every fault
                    verdict = "error"
                    with lock:
                        failures.append(f"{name} {prop}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                with lock:
                    counts[name][verdict] += 1

    before = memory()
    start = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    after = memory()
    done = sum(sum(c.values()) for c in counts.values())
    return {"impl": impl, "calls": done, "not_run": calls - done, "threads": threads, "seconds": round(elapsed, 1),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "memory_before": before, "memory_after": after,
            "max_memory": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
            "per_convention": {n: dict(c) for n, c in counts.items()}, "failures": failures[:50]}


def in_processes(args) -> dict:
    """`stress` in args.processes processes of this module, their reports summed."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(args.processes):
            cmd = [sys.executable, "-m", __spec__.name, "--impl", args.impl, "--threads", str(args.threads),
                   "--calls", str(-(-args.calls // args.processes)), "--seed", str(args.seed + i),
                   "--distinct", str(args.distinct), "--seconds", str(args.seconds),
                   "--json", os.path.join(tmp, f"{i}.json")]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        for proc in procs:
            proc.wait()
        reports = []
        for i in range(args.processes):
            path = os.path.join(tmp, f"{i}.json")
            if not os.path.exists(path):
                raise SystemExit(f"stress process {i} wrote no report (exit status {procs[i].returncode})")
            with open(path) as f:
                reports.append(json.load(f))
    total = Counter()
    per = {}
    for r in reports:
        for name, c in r["per_convention"].items():
            per.setdefault(name, Counter()).update(c)
    for key in ("calls", "not_run"):
        total[key] = sum(r[key] for r in reports)
    growth = max(r["memory_after"] - r["memory_before"] for r in reports)
    return {"impl": args.impl, "calls": total["calls"], "not_run": total["not_run"],
            "threads": args.threads * args.processes, "processes": args.processes,
            "seconds": max(r["seconds"] for r in reports), "device": reports[0]["device"],
            "memory_before": max(r["memory_before"] for r in reports),
            "memory_after": max(r["memory_before"] for r in reports) + growth,
            "max_memory": max(r["max_memory"] for r in reports),
            "memory_growth_per_process": [r["memory_after"] - r["memory_before"] for r in reports],
            "per_convention": {n: dict(c) for n, c in per.items()},
            "failures": [line for r in reports for line in r["failures"]][:50]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="rope")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distinct", type=int, default=64, help="plans drawn per convention, reused with new seeds")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="start no call after this many seconds")
    parser.add_argument("--processes", type=int, default=1, help="processes sharing the device (host-bound checks)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.processes > 1:
        refuse_interpreted_threads(registry.resolve(args.impl), args.threads)
        report = in_processes(args)
    else:
        report = stress(args.impl, args.calls, args.threads, args.seed, args.seconds, args.distinct)
    for name, c in report["per_convention"].items():
        print(f"{name:15s} {sum(c.values()):6d} calls  {c.get('wrong', 0):4d} wrong  {c.get('error', 0):4d} errors")
    print(f"{report['calls']} calls ({report['not_run']} not run) on {report['threads']} threads in "
          f"{report['seconds']} s ({report['device']}); "
          f"device memory {report['memory_before']} -> {report['memory_after']} bytes, peak {report['max_memory']}")
    for line in report["failures"]:
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = sum(c.get("wrong", 0) + c.get("error", 0) for c in report["per_convention"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
