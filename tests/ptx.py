"""Compile the kernels for a GPU target on any machine (no GPU needed) and summarize the PTX.

    python -m tests.ptx                 # sm_90, a few representative variants
    python -m tests.ptx --arch 80

What it answers without device time: are the global loads and stores 16 bytes wide
(`ld.global.v4.b32`), how many sin/cos each thread evaluates (inlined libdevice `__nv_sinf`
calls; approximate `sin.approx` instructions must never appear), and how much shared memory the
pinned cos/sin move takes. Strides other than the last are marked divisible by 16 and the last
as 1, as Triton specializes them for contiguous tensors at run time.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget

from rope._kernel import rope_kernel, rope_qk_kernel

CONSTEXPRS = ("HEAD_DIM", "ROT_DIM", "INTERLEAVED", "BACKWARD", "IS_THD", "GROUP_PER_BATCH", "HAS_START", "USE_CP",
              "BLOCK_R", "BLOCK_HALF", "BLOCK_TAIL", "RNE_BF16", "PIN", "INPLACE", "TABLE", "SPLIT", "FANOUT",
              "POS_TABLE")


def compile_variant(kernel, arch=90, dtype="bf16", d=128, d2=128, interleaved=False, backward=False, thd=False,
                    start=False, cp=False, inplace=False, block_r=8, num_warps=2, table=False, split=False,
                    pos_table=False):
    block_half = triton.next_power_of_2(d2 // 2)
    block_tail = triton.next_power_of_2(d - d2) if d > d2 else 0
    values = dict(HEAD_DIM=d, ROT_DIM=d2, INTERLEAVED=interleaved, BACKWARD=backward, IS_THD=thd,
                  GROUP_PER_BATCH=start and not thd, HAS_START=start, USE_CP=cp, BLOCK_R=block_r,
                  BLOCK_HALF=block_half, BLOCK_TAIL=block_tail, RNE_BF16=False, PIN=True, INPLACE=inplace,
                  TABLE=table, SPLIT=split, FANOUT=32 if thd and not pos_table else 1,
                  POS_TABLE=pos_table)
    signature, constexprs, attrs = {}, dict(values), {}
    for i, name in enumerate(kernel.arg_names):
        if name in CONSTEXPRS:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            index = "*i64" if pos_table else "*i32"
            signature[name] = {"freqs_ptr": "*fp32", "start_ptr": "*i32", "cu_ptr": index}.get(name, "*" + dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("stride") and name.endswith("d"):  # last-dim strides of contiguous tensors
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i64" if name.startswith("stride") else "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))


def summarize(compiled) -> str:
    ptx = compiled.asm["ptx"]
    loads = Counter(re.findall(r"ld\.global[\.\w:]*", ptx))
    stores = Counter(re.findall(r"st\.global[\.\w:]*", ptx))
    return (f"sin {ptx.count('__nv_sinf.exit')} cos {ptx.count('__nv_cosf.exit')} "
            f"approx {ptx.count('sin.approx') + ptx.count('cos.approx')} shared {compiled.metadata.shared} B | "
            f"loads {dict(loads)} | stores {dict(stores)}")


VARIANTS = [
    ("half-split bf16 d128", dict()),
    ("interleaved bf16 d128", dict(interleaved=True, block_r=16)),
    ("half-split fp32 d256", dict(dtype="fp32", d=256, d2=256, num_warps=8)),
    ("partial 64/128 bf16", dict(d2=64, num_warps=2)),
    ("thd + start_positions", dict(thd=True, start=True)),
    ("in place, cp", dict(inplace=True, cp=True)),
    ("table, half-split bf16 d128", dict(table=True, block_r=8, num_warps=1, split=True)),
    ("table, thd bf16 d128", dict(table=True, thd=True, block_r=8, num_warps=1, split=True)),
    ("table, thd positions bf16", dict(table=True, thd=True, pos_table=True, block_r=8, num_warps=1, split=True)),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    for kernel in (rope_kernel, rope_qk_kernel):
        for name, kw in VARIANTS:
            print(f"{kernel.fn.__name__:15s} {name:24s} {summarize(compile_variant(kernel, args.arch, **kw))}")


if __name__ == "__main__":
    main()
