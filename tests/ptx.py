"""Compile the kernels for a GPU target on any machine (no GPU needed) and summarize the PTX.

    python -m tests.ptx                 # sm_90, a few representative variants
    python -m tests.ptx --arch 80
    python -m tests.ptx --compare OLD               # same PTX as another version of the kernels?

OLD is a copy of the kernels of another version: a package directory like rope/kernels/, or a single module holding
the four kernels (rope/_kernel.py in versions without rope/kernels/: `git show REV:rope/_kernel.py > OLD.py`).

What it answers without device time: are the global loads and stores 16 bytes wide
(`ld.global.v4.b32`), how many sin/cos each thread evaluates (inlined libdevice `__nv_sinf`
calls; approximate `sin.approx` instructions must never appear), and how much shared memory the
pinned cos/sin move takes. Strides other than the last are marked divisible by 16 and the last
as 1, as Triton specializes them for contiguous tensors at run time.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget

from rope import kernels

CONSTEXPRS = ("HEAD_DIM", "ROT_DIM", "INTERLEAVED", "BACKWARD", "IS_THD", "GROUP_PER_BATCH", "HAS_START", "USE_CP",
              "BLOCK_R", "BLOCK_HALF", "BLOCK_TAIL", "RNE_BF16", "PIN", "INPLACE", "TABLE", "SPLIT", "FANOUT",
              "POS_TABLE", "HALF_TABLE", "MROPE", "SEC0", "SEC1", "SEC2", "QK", "PDL", "NORM", "BLOCK_D", "FP8",
              "FP8_BITS", "EAGER", "PERMUTE", "ROT_START", "MULTI_TILE", "LANES_Q", "LANES_K", "VEC")
# pointer types other than the tensors' dtype (cache kernel: the caches are e4m3 with fp8), by the pointer's role
POINTERS = {"cos_or_freqs_ptr": "*fp32", "start_positions_ptr": "*i32", "weight_grad_partials_ptr": "*fp32",
            "slot_mapping_ptr": "*i64", "positions_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
            "cos_table_ptr": "*fp32", "sin_table_ptr": "*fp32"}
# The pointers' names in the single-file kernels (rope/_kernel.py), which --compare may be given: name -> role
_OLD_POINTER_NAMES = {"qo_ptr": "q_out_ptr", "ko_ptr": "k_out_ptr", "freqs_ptr": "cos_or_freqs_ptr",
                      "start_ptr": "start_positions_ptr", "cu_ptr": "cu_seqlens_or_positions_ptr",
                      "wq_ptr": "q_weight_ptr", "wk_ptr": "k_weight_ptr", "sq_ptr": "q_input_ptr",
                      "sk_ptr": "k_input_ptr", "part_ptr": "weight_grad_partials_ptr", "kc_ptr": "key_cache_ptr",
                      "vc_ptr": "value_cache_ptr", "slot_ptr": "slot_mapping_ptr", "pos_ptr": "positions_ptr",
                      "cos_ptr": "cos_table_ptr", "ks_ptr": "k_scale_ptr", "vs_ptr": "v_scale_ptr"}


def _pointer_role(kernel, name: str) -> str:
    """What a pointer argument holds, under the current kernels' names (an older kernel's names are mapped)."""
    if name == "sin_ptr" and "cos_ptr" in kernel.arg_names:  # the single-file cache kernel's half sin table
        return "sin_table_ptr"
    return _OLD_POINTER_NAMES.get(name, name)


def compile_variant(kernel, arch=90, dtype="bf16", d=128, d2=128, interleaved=False, backward=False, thd=False,
                    start=False, cp=False, inplace=False, block_r=8, num_warps=2, table=False, split=False,
                    pos_table=False, mrope=0, sections=(0, 0, 0), pdl=False, norm=0, fp8=False,
                    eager=False, permute=0, rot_start=0, multi_tile=True, lanes=(32, 32)):
    block_half = triton.next_power_of_2(d2 // 2)
    block_tail = triton.next_power_of_2(d - d2) if d > d2 else 0
    if norm:
        block_tail = max(block_tail, 1)  # as the launcher: the norm's tail is one masked column where there is none
    values = dict(HEAD_DIM=d, ROT_DIM=d2, INTERLEAVED=interleaved, BACKWARD=backward, IS_THD=thd,
                  GROUP_PER_BATCH=start and not thd, HAS_START=start, USE_CP=cp, BLOCK_R=block_r,
                  BLOCK_HALF=block_half, BLOCK_TAIL=block_tail, RNE_BF16=False, PIN=True, INPLACE=inplace,
                  TABLE=table, SPLIT=split, FANOUT=32 if thd and not pos_table else 1,
                  POS_TABLE=pos_table, HALF_TABLE=False, MROPE=mrope, SEC0=sections[0], SEC1=sections[1],
                  SEC2=sections[2], QK=True, PDL=pdl, NORM=norm, BLOCK_D=triton.next_power_of_2(d), FP8=fp8,
                  FP8_BITS=False, EAGER=eager, PERMUTE=permute, ROT_START=rot_start, MULTI_TILE=multi_tile,
                  LANES_Q=lanes[0], LANES_K=lanes[1], VEC=4 if d >= 128 else 1)
    values = {name: v for name, v in values.items() if name in kernel.arg_names}  # an older kernel may lack some
    cache_type = "*fp8e4nv" if fp8 else "*" + dtype
    signature, constexprs, attrs = {}, dict(values), {}
    for i, name in enumerate(kernel.arg_names):
        if name in CONSTEXPRS:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            types = {**POINTERS, "cu_seqlens_or_positions_ptr": "*i64" if pos_table else "*i32",
                     "key_cache_ptr": cache_type, "value_cache_ptr": cache_type}
            signature[name] = types.get(_pointer_role(kernel, name)) or "*" + dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.endswith("_strides"):  # a tensor's strides, one tuple: the last, its channels', of a contiguous one
            rank = 3 if name == "positions_strides" or ("key_cache_ptr" in kernel.arg_names
                                                         and name in ("q_strides", "k_strides", "v_strides")) else 4
            unit = rank - 1 if name != "positions_strides" else None
            signature[name] = tuple("constexpr" if j == unit else "i64" for j in range(rank))
            for j in range(rank):
                if j == unit:
                    constexprs[(i, j)] = 1
                else:
                    attrs[(i, j)] = [["tt.divisibility", 16]]
        elif name.startswith("stride") and name.endswith("d"):  # last-dim strides of contiguous tensors
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name in ("eps", "factor_q", "factor_k"):
            signature[name] = "fp32"
        else:
            # divisor constants are int64 whatever their value (`rope._launch.magic`), as Triton passes them
            signature[name] = "i64" if name.startswith(("stride", "magic")) else "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    # without fused multiply-adds, as every plan of the launcher compiles (`rope._launch.Plan`)
    options = dict(num_warps=num_warps, enable_fp_fusion=False)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


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
    ("table, thd mRoPE positions bf16", dict(table=True, thd=True, pos_table=True, block_r=8, num_warps=1, split=True,
                                             mrope=1, sections=(16, 24, 24))),
    ("table, fp32 d256 backward", dict(table=True, dtype="fp32", d=256, d2=256, backward=True, split=True)),
    ("interleaved partial backward", dict(interleaved=True, d2=64, backward=True, block_r=16, num_warps=4)),
    ("table, thd start + cp", dict(table=True, thd=True, start=True, cp=True, split=True)),
    ("table, start in place", dict(table=True, start=True, inplace=True)),
    ("fp16 d80 partial, split", dict(dtype="fp16", d=80, d2=64, split=True)),
    ("table, thd positions, PDL", dict(table=True, thd=True, pos_table=True, block_r=8, num_warps=1, pdl=True)),
    ("table, eager schedule", dict(table=True, block_r=8, num_warps=1, eager=True)),
    ("table, DeepSeek-V3 pairs, d64", dict(table=True, d=64, d2=64, block_r=8, num_warps=1, permute=1)),
    ("table, DeepSeek-V3 pairs, backward", dict(table=True, d=64, d2=64, block_r=8, num_warps=1, permute=2,
                                                backward=True)),
]
# rope_qknorm_kernel (the launcher's table tile: 8 rows, one warp for bf16 d 128) and rope_cache_kernel
NORM_VARIANTS = [
    ("norm fwd, table bf16 d128", dict(table=True, norm=1, num_warps=1, split=True)),
    ("norm fwd, table bf16 d128, programs of one tile", dict(table=True, norm=1, num_warps=1, split=True,
                                                              multi_tile=False)),
    ("norm fwd, eager, rows of q and k apart", dict(table=True, norm=1, num_warps=1, split=True, eager=True,
                                                     lanes=(32, 64))),
    ("norm fwd, eager, sums from the tile", dict(table=True, norm=1, num_warps=1, split=True, eager=True)),
    ("norm bwd, table bf16 d128", dict(table=True, norm=1, num_warps=1, split=True, backward=True)),
    ("norm fwd, Gemma, interleaved", dict(table=True, norm=2, interleaved=True, num_warps=2, split=True)),
    ("norm fwd, partial 64/128 fp32", dict(table=True, norm=1, dtype="fp32", d2=64, num_warps=2, split=True)),
    ("norm fwd, thd positions, mRoPE", dict(table=True, norm=1, thd=True, pos_table=True, num_warps=1, split=True,
                                            mrope=2, sections=(24, 20, 20))),
    ("norm fwd, freqs, start", dict(norm=1, start=True, num_warps=1, split=True)),
]
CACHE_VARIANTS = [
    ("cache bf16 d128, 16 rows", dict(block_r=16, num_warps=2, split=True)),
    ("cache fp8 d128, 8 rows", dict(block_r=8, num_warps=1, split=True, fp8=True)),
    ("cache interleaved partial 64/128", dict(block_r=8, num_warps=1, split=True, interleaved=True, d2=64)),
]


KERNELS = {"rope_kernel": VARIANTS, "rope_qk_kernel": VARIANTS, "rope_qknorm_kernel": NORM_VARIANTS,
           "rope_cache_kernel": CACHE_VARIANTS}


def _code(ptx: str) -> str:
    """The instructions of a PTX file, without comments, debug sections, line records and labels."""
    ptx = re.sub(r"\.section\s+\.debug.*", "", re.sub(r"//.*", "", ptx), flags=re.S)
    lines = (line.strip() for line in ptx.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith((".loc", ".file", "$L__tmp")))


def _load_kernels(path: str):
    """The kernels of another version: a package directory (its __init__ names the kernels) or a single module."""
    import importlib.util
    from pathlib import Path

    where = Path(path)
    if where.is_dir():
        spec = importlib.util.spec_from_file_location("rope_kernels_compared", where / "__init__.py",
                                                      submodule_search_locations=[str(where)])
    else:
        spec = importlib.util.spec_from_file_location("rope_kernels_compared", where)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a package's modules import each other by relative name
    spec.loader.exec_module(module)
    return module


def compare(old_path: str, arch: int = 90) -> int:
    """Compile every variant with the kernels of `old_path` (`_load_kernels`) and with the current ones, kernel by
    kernel name; print which differ, return how many. Identical PTX means a refactoring changed nothing the GPU
    runs, for these variants. PTX names a kernel's parameters by position (`NAME_param_3`) and its inlined helpers
    not at all, so renamed parameters and helpers leave it unchanged; the kernel's own name is replaced by K, and
    comments, debug sections and line records are dropped (`_code`). Each pointer gets its type by role
    (`_pointer_role`), whatever its name in either version."""
    old = _load_kernels(old_path)
    differ = 0
    for kernel_name, variants in KERNELS.items():
        if not hasattr(old, kernel_name):  # an older version may lack the later kernels
            continue
        kernel, old_kernel = getattr(kernels, kernel_name), getattr(old, kernel_name)
        for name, kw in variants:
            new_code = _code(compile_variant(kernel, arch, **kw).asm["ptx"]).replace(kernel_name, "K")
            old_code = _code(compile_variant(old_kernel, arch, **kw).asm["ptx"]).replace(kernel_name, "K")
            same = new_code == old_code
            differ += not same
            print(f"{kernel_name:18s} {name:32s} {'identical' if same else 'DIFFERENT'}", flush=True)
    return differ


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--compare", metavar="OLD", help="the kernels of another version: a directory or a .py file")
    args = parser.parse_args(argv)
    if args.compare:
        raise SystemExit(1 if compare(args.compare, args.arch) else 0)
    for kernel_name, variants in KERNELS.items():
        kernel = getattr(kernels, kernel_name)
        for name, kw in variants:
            print(f"{kernel_name:18s} {name:32s} {summarize(compile_variant(kernel, args.arch, **kw))}")


if __name__ == "__main__":
    main()
