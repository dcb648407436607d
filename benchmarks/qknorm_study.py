"""QK-norm + RoPE bandwidth: the launch parameters of `rope.qknorm.apply`, swept in CUDA graphs of one run.

    python benchmarks/qknorm_study.py [--json PATH]

At the Qwen3-8B attention shape (q 32 / k 8 heads, d 128, bf16) at 4K and 16K tokens, with a copy of q and k
(`clone`, the same bytes read and written) as the bound:
- forward: the table kernel's tile (`rope._launch._TABLE_ROWS` rows, `_TABLE_BYTES_PER_THREAD` bytes of each
  row-half per thread), which the norm kernel takes as the rotation kernels do;
- forward: the register cap (`_NORM_FWD_MAXNREG`, 16-bit half-split tiles), also with Gemma's (1 + w) and with
  partial rotary (64 of 128 channels), at 4K tokens;
- forward + backward: the backward's rows per work item (`_NORM_ROWS`) and programs per SM
  (`_NORM_PROGRAMS_PER_SM`), whose partial weight gradients are summed after.
The first setting of each sweep is the launcher's default.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import bench_qknorm as bq  # noqa: E402

import rope  # noqa: E402
import rope._launch as launch  # noqa: E402


def settings(**values):
    """A context setting rope._launch's constants, plans made afresh inside and after."""
    class Setting:
        def __enter__(self):
            self.old = {k: getattr(launch, k) for k in values}
            for k, v in values.items():
                setattr(launch, k, v)
            rope.clear_caches()

        def __exit__(self, *exc):
            for k, v in self.old.items():
                setattr(launch, k, v)
            rope.clear_caches()
    return Setting()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    res = {"device": torch.cuda.get_device_name()}
    for shape in ("prefill4k", "prefill16k"):
        a = bq.inputs("qwen3-8b", shape)
        q, k = a[0], a[1]
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
        clone = bq.graph_us(lambda q=q, k=k: (q.clone(), k.clone()))
        print(f"\n{shape}: clone of q and k {clone:.2f} µs ({nbytes / clone / 1e3:.0f} GB/s)")
        res[shape] = {"clone_us": clone, "fwd": {}, "fwd+bwd": {}}
        default_fwd = (launch._TABLE_ROWS, launch._TABLE_BYTES_PER_THREAD)
        for rows, per_thread in [default_fwd, *[c for c in itertools.product((8, 16, 32), (16, 32))
                                                if c != default_fwd]]:
            with settings(_TABLE_ROWS=rows, _TABLE_BYTES_PER_THREAD=per_thread):
                bq.check(bq.fused_path, a)
                us = bq.graph_us(bq.calls(bq.fused_path, a, "fwd"))
            res[shape]["fwd"][f"{rows} rows, {per_thread} B"] = us
            print(f"  fwd  {rows:3d} rows {per_thread:3d} B/thread  {us:7.2f} µs  {clone / us:.2f} of copy")
        for cap in (launch._NORM_FWD_MAXNREG, None):
            with settings(_NORM_FWD_MAXNREG=cap):
                us = bq.graph_us(bq.calls(bq.fused_path, a, "fwd"))
            res[shape]["fwd"][f"register cap {cap}"] = us
            print(f"  fwd  register cap {cap}  {us:7.2f} µs  {clone / us:.2f} of copy")
        default_bwd = (launch._NORM_ROWS, launch._NORM_PROGRAMS_PER_SM)
        for rows, progs in [default_bwd, *[c for c in itertools.product((64, 128), (4, 8, 16))
                                           if c != default_bwd]]:
            with settings(_NORM_ROWS=rows, _NORM_PROGRAMS_PER_SM=progs):
                us = bq.graph_us(bq.calls(bq.fused_path, a, "fwd+bwd"))
            res[shape]["fwd+bwd"][f"{rows} rows, {progs} programs/SM"] = us
            print(f"  fwd+bwd {rows:3d} rows {progs} programs/SM  {us:7.2f} µs")
        for name in ("torch", "hf_compiled"):
            us = bq.graph_us(bq.calls(bq.implementation(name), a, "fwd+bwd"))
            res[shape]["fwd+bwd"][f"unfused {name}"] = us
            print(f"  fwd+bwd unfused {name}  {us:7.2f} µs")
    a = bq.inputs("qwen3-8b", "prefill4k")
    cos, sin = a[4], a[5]
    forms = {"Gemma's 1 + w": (a, dict(gemma=True)),
             "partial rotary 64/128": ((*a[:4], cos[..., :64].contiguous(), sin[..., :64].contiguous()), {})}
    print("\nprefill4k, other forms")
    for name, (args_, kw) in forms.items():
        def fn(*x, kw=kw):
            return rope.qknorm.apply(*x, eps=bq.EPS, unsqueeze_dim=2, **kw)
        for cap in (launch._NORM_FWD_MAXNREG, None):
            with settings(_NORM_FWD_MAXNREG=cap):
                us = bq.graph_us(bq.calls(fn, args_, "fwd"))
            res.setdefault("prefill4k forms", {})[f"{name}, register cap {cap}"] = us
            print(f"  fwd  {name:24s} register cap {cap}  {us:7.2f} µs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
