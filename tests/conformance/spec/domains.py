"""Declared domains: for every argument of a convention's SIGNATURE, the classes of values it allows.

A convention declares `DOMAIN = {argument: (Class, ...)}`, once. A class is a named set of values (a dtype
pairing, a size, a layout, an optional argument omitted / passed at its default / passed otherwise) with:
    holds(plan, case) -> bool   whether a drawn plan (and the case built from it) is in the class
    off(caps) -> bool            whether the capabilities in force switch the class off (it is then not drawn)
    cap                          the capability that does, for the report
The strategies (`Convention.plans`) draw the classes; `classes_of` names the classes a plan drew, so a test sees
coverage (test_domains.py: every class the default capabilities allow is drawn within the CPU budget), and
`declared_off` lists what a target's capabilities leave out ("not certified: ...").

Classes every convention shares are built by the helpers below (dtype pairings, sizes, layouts, optional
arguments, upstream gradient layouts); the generic capabilities (GENERIC_CAPS) switch off the shared classes
a target cannot take.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from hypothesis import strategies as st

SIXTEEN = (torch.float16, torch.bfloat16)


class Class(NamedTuple):
    name: str
    holds: Callable  # (plan, case) -> bool
    off: Callable = None  # (caps) -> bool; None: always allowed
    cap: str = ""  # the capability that switches it off (for the report)


def _never(caps):
    return False


def cls(name: str, holds: Callable, cap: str = "", off: Callable = None) -> Class:
    """A class; `cap` alone switches it off when that capability is false."""
    if off is None:
        off = (lambda caps: not caps.get(cap, True)) if cap else _never
    return Class(name, holds, off, cap)


# ------------------------------------------------------------------------------------------- generic capabilities
GENERIC_CAPS = {
    "explicit_defaults": (True, "optional arguments passed explicitly at their default value, as well as omitted"),
    "deterministic": (True, "two identical calls give bitwise the same outputs (and gradients)"),
    "batch_invariant": (True, "a row's results do not depend on the other rows of the call, bitwise "
                              "(invariant batch_rows_alone)"),
}
DIFFERENTIABLE_CAPS = {
    "strided_grads": (True, "upstream gradients that are strided views (a slice of a wider buffer, permuted)"),
    "expanded_grads": (True, "upstream gradients expanded over a dim (stride 0)"),
}


def generic_caps(conv) -> dict:
    return {**GENERIC_CAPS, **(DIFFERENTIABLE_CAPS if conv.DIFFERENTIABLE else {})}


# ------------------------------------------------------------------------------------------------- class helpers
def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def dtypes(get: Callable, cap: str = "dtypes", choices=(torch.float32, torch.float16, torch.bfloat16)) -> tuple:
    """One class per dtype `get(plan)` may be; off where the capability `cap` (a tuple of dtypes) leaves it out."""
    return tuple(cls(_dtype_name(dt), lambda p, c, dt=dt: get(p) == dt, cap,
                     lambda caps, dt=dt: dt not in caps.get(cap, (dt,))) for dt in choices)


def pairings(get: Callable, mixed_cap: str = "mixed_tables", float32_cap: str = "float32_tables",
             mixed_off: Callable = None, float32_off: Callable = None) -> tuple:
    """The pairings of an input's dtype and a table's, `get(plan) -> (input dtype, table dtype)`: the same dtype,
    a float32 table with a 16-bit input, the other 16-bit dtype (fp16 with bf16 and the reverse), a 16-bit table
    with a float32 input (only where the convention draws it: pass the classes wanted)."""
    return (
        cls("same dtype", lambda p, c: get(p)[0] == get(p)[1]),
        cls("float32 table, 16-bit input", lambda p, c: get(p)[0] in SIXTEEN and get(p)[1] == torch.float32,
            float32_cap, float32_off),
        cls("other 16-bit table", lambda p, c: get(p)[0] in SIXTEEN and get(p)[1] in SIXTEEN and
            get(p)[0] != get(p)[1], mixed_cap, mixed_off),
    )


def table_dtypes(dtype, caps, float32_cap: str = "float32_tables", mixed_cap: str = "mixed_tables") -> tuple:
    """The dtypes a table may have with an input of `dtype`: the same; float32 (`float32_cap`); the other 16-bit
    dtype, or a 16-bit one with a float32 input (`mixed_cap`)."""
    out = [dtype]
    if caps.get(float32_cap) and dtype != torch.float32:
        out.append(torch.float32)
    if caps.get(mixed_cap):
        out += [t for t in SIXTEEN if t != dtype]
    return tuple(out)


def any_dtype(dtype) -> tuple:
    """Every float dtype a tensor the convention takes in 'any' dtype may have with an input of `dtype`: the
    input's, float32, the other 16-bit one (a 16-bit one with a float32 input)."""
    return (torch.float32,) + tuple(t for t in SIXTEEN if t != dtype) + (dtype,)


def table_16bit_float32_input(get: Callable, cap: str = "", off: Callable = None) -> Class:
    return cls("16-bit table, float32 input", lambda p, c: get(p)[0] == torch.float32 and get(p)[1] in SIXTEEN,
               cap, off)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def sizes(get: Callable, empty_cap: str = "", what: str = "", empty: bool = True, one: bool = True,
          pow2: bool = False) -> tuple:
    """The size `get(plan)` of a dim: 0 (an empty tensor, where allowed), 1, a non-power of two above 2 (what a
    kernel tuned for powers of two gets wrong), and, with `pow2`, a power of two above 1."""
    pre = f"{what} " if what else ""
    out = []
    if empty:
        out.append(cls(f"{pre}0 (empty)", lambda p, c: get(p) == 0, empty_cap))
    if one:
        out.append(cls(f"{pre}1", lambda p, c: get(p) == 1))
    if pow2:
        out.append(cls(f"{pre}power of two > 1", lambda p, c: get(p) > 1 and _is_pow2(get(p))))
    out.append(cls(f"{pre}not a power of two", lambda p, c: get(p) > 2 and not _is_pow2(get(p))))
    return tuple(out)


def layout_kind(t) -> str:
    """How tensor `t` lies in memory: "contiguous" (the whole of its storage, dense strides, size-1 dims
    included), "expanded" (a dim of size > 1 with stride 0), else "strided" (a view: sliced, permuted, padded, or
    a size-1 dim with a stride no dense layout gives it)."""
    if not isinstance(t, torch.Tensor):
        return ""
    if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride(), strict=True)):
        return "expanded"
    dense, step = [], 1
    for n in reversed(t.shape):
        dense.insert(0, step)
        step *= n
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return "contiguous" if list(t.stride()) == dense and whole else "strided"


def layouts(arg: str, cap: str = "strides", expanded: bool = False) -> tuple:
    """Layout classes of the built argument `arg`: contiguous, a strided view, and (`expanded`) expanded."""
    return (cls("contiguous", lambda p, c: layout_kind(c.args.get(arg)) == "contiguous"),
            cls("strided view", lambda p, c: layout_kind(c.args.get(arg)) == "strided", cap),
            *((cls("expanded (stride 0)", lambda p, c: layout_kind(c.args.get(arg)) == "expanded", cap),)
              if expanded else ()))


def spaced(arg: str, cap: str = "strides") -> cls:
    """The built argument `arg` with its last dim every other element (stride 2), as an index tensor sliced from a
    wider one (`ids[:, 0]`): a reader of its data pointer as dense reads the elements between."""
    def spaced_out(p, c):
        t = c.args.get(arg)
        return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) > 1
    return cls("every other element (last-dim stride 2)", spaced_out, cap)


def flags(get: Callable, values=(False, True), names=None, cap: str = "", allowed: Callable = None) -> tuple:
    """One class per value of a flag (or any small set of values); `allowed(caps)`: the values the capabilities
    allow (a value outside is off), else `cap` switches the non-first values off when false."""
    names = names or [str(v) for v in values]
    out = []
    for i, (n, v) in enumerate(zip(names, values, strict=True)):
        off = (lambda caps, v=v: v not in allowed(caps)) if allowed else None
        out.append(cls(n, lambda p, c, v=v: get(p) == v, cap if (allowed or i) else "", off))
    return tuple(out)


def optional(name: str, other: str = "another value", other_cap: str = "", other_off: Callable = None,
             cap: str = "") -> tuple:
    """An optional argument: omitted, passed explicitly at its default, passed with another value. Read from the
    built case (which arguments the call passes: Case.call). `cap`: a capability that, false, says the target has
    no such parameter (then only omitted is drawn)."""
    def explicit_off(caps):
        return not caps.get("explicit_defaults", True) or (cap and not caps.get(cap, True))

    def other_is_off(caps):
        return (cap and not caps.get(cap, True)) or (other_off(caps) if other_off else
                                                      bool(other_cap) and not caps.get(other_cap, True))

    return (cls("omitted", lambda p, c: passed(c, name) is None),
            cls("explicit default", lambda p, c: passed(c, name) == "default", "explicit_defaults", explicit_off),
            cls(other, lambda p, c: passed(c, name) == "other", other_cap or cap, other_is_off))


def is_default(value, default) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return False
    return value is default or (type(value) is type(default) and value == default)


def passed(case, name: str):
    """How the call passes `name`: None (omitted), "default" (given, at its default), "other"."""
    if name not in case.args or name in case.omit:
        return None
    return "default" if is_default(case.args[name], case.optional.get(name)) else "other"


def settle_defaults(conv, case):
    """The optional arguments as the plan says: each one at its default that the build passes by keyword is
    omitted unless the plan passes defaults explicitly; each one the build leaves out is passed at its default
    when it does."""
    explicit = getattr(case.plan, "explicit_defaults", False)
    names = list(case.args)
    case.optional = dict(conv.OPTIONAL)
    for name, default in conv.OPTIONAL.items():
        if name in case.args:
            if names.index(name) >= case.positional and is_default(case.args[name], default) and not explicit:
                case.omit = (*case.omit, name)
        elif explicit and case.caps.get(name, True) is not False:  # a capability false: no such parameter
            case.args[name] = default
    return case


def with_explicit(plans: st.SearchStrategy, caps) -> st.SearchStrategy:
    """A plan strategy whose plans (with an `explicit_defaults` field) pass optional arguments at their defaults
    explicitly or not, as drawn (first: Hypothesis varies early choices most)."""
    flag = st.booleans() if caps.get("explicit_defaults", True) else st.just(False)
    return st.tuples(flag, plans).map(lambda drawn: drawn[1]._replace(explicit_defaults=drawn[0]))


def lengths(few: tuple, empty: bool, top: int, small_shapes: bool) -> st.SearchStrategy:
    """A sequence length: on the CPU from `few` (0 first where `empty`: each class is drawn within a few examples,
    and Hypothesis starts from the first), on a device also any length up to `top`."""
    few = (0,) * empty + tuple(few)
    return st.sampled_from(few) if small_shapes else st.one_of(st.sampled_from(few), st.integers(1, top))


def size(draw, low: int, top: int, empty: bool, rate: int = 8) -> int:
    """Drawn by a plan strategy: a dim's size from `low` to `top`, or 0 (an empty tensor) where `empty`: about one
    draw in `rate`, on the CPU and on a device alike, and in a run's first plan (Hypothesis starts from its simplest
    choices: the gate's 0)."""
    if empty and draw(st.integers(0, rate - 1)) == 0:
        return 0
    return draw(st.integers(low, top))


def empty_dims(draw, empty: bool, dims: tuple, rate: int = 8, all_first: bool = True, first: bool = True) -> tuple:
    """Drawn by a plan strategy: which of `dims` (names) are 0, an empty tensor, () for none: about one plan in
    `rate` where `empty`; then all of them or one. Hypothesis' simplest choice, a run's first plan, is empty (without
    `first`: not, where the simplest plan is a class the run must draw too), with all of them (each dim's class drawn
    at once) or, without `all_first`, the first alone (where the other dims' simplest sizes are such classes)."""
    if empty and draw(st.integers(0, rate - 1)) == (0 if first else rate - 1):
        one = tuple((d,) for d in dims)
        return draw(st.sampled_from((tuple(dims), *one) if all_first else (*one, tuple(dims))))
    return ()


def with_empty(plans: st.SearchStrategy, caps, zero: Callable, dims: tuple, rate: int = 8,
               all_first: bool = True, first: bool = True) -> st.SearchStrategy:
    """`plans`, about one in `rate` (where the capability `empty` allows it) with some of `dims` 0 (empty_dims):
    `zero(plan, names)` gives the plan with those dims 0. Drawn after the plan, so that its other choices stay as
    they were."""
    @st.composite
    def draw(draw):
        plan = draw(plans)
        names = empty_dims(draw, caps.get("empty", False), dims, rate, all_first, first)
        return zero(plan, names) if names else plan

    return draw()


def zeroed(plan, names):
    """The plan with the fields `names` 0 (with_empty's default `zero`)."""
    return plan._replace(**{n: 0 for n in names})


def explicit_defaults(draw, caps) -> bool:
    """Drawn by a plan strategy: whether the call passes its optional arguments at their defaults explicitly."""
    return draw(st.booleans()) if caps.get("explicit_defaults", True) else False


def index_dtypes(get: Callable, cap: str) -> tuple:
    """An index tensor's dtype `get(plan)`: int64, or int32 where the capability `cap` allows it."""
    return (cls("int64", lambda p, c: get(p) == torch.int64),
            cls("int32", lambda p, c: get(p) == torch.int32, cap))


def head_counts(get: Callable, cap: str = "gqa", none: Callable = None, none_cap: str = "") -> tuple:
    """A second tensor's heads against the first's, `get(plan) -> (first's, second's)`: as many, fewer (GQA),
    and None where `none(plan)` says the tensor is left out."""
    out = (cls("as many heads", lambda p, c: get(p)[1] == get(p)[0]),
           cls("another head count (GQA)", lambda p, c: 0 < get(p)[1] != get(p)[0], cap))
    if none is not None:
        out += (cls("None", lambda p, c: none(p), none_cap),)
    return out


def cache_dtype_classes(get: Callable, any_of: Callable) -> tuple:
    """A cos/sin cache's dtype against the input's, `get(plan) -> (input's, cache's)`, where `any_of(caps)` says
    any float dtype is allowed (else only the input's)."""
    def off(caps):
        return not any_of(caps)

    return (*pairings(get, mixed_off=off, float32_off=off), table_16bit_float32_input(get, off=off))


def widths(get: Callable, cap: str = "partial") -> tuple:
    """The rotary width against the head, `get(plan) -> (rotary width, head dim)`."""
    return (cls("the whole head", lambda p, c: get(p)[0] >= get(p)[1] - get(p)[1] % 2),
            cls("narrower than the head", lambda p, c: get(p)[0] < get(p)[1] - get(p)[1] % 2, cap))


def odd_heads(get: Callable, cap: str = "partial") -> tuple:
    """The head dim `get(plan)`: even, odd (a channel past every pair)."""
    return (cls("even head dim", lambda p, c: get(p) % 2 == 0),
            cls("odd head dim", lambda p, c: get(p) % 2 == 1, cap))


# ---------------------------------------------------------------------------------------- upstream gradients
UPSTREAMS = ("contiguous", "strided", "expanded")


def upstreams(caps) -> st.SearchStrategy:
    """The layout of the upstream gradients the backward property passes."""
    kinds = ["contiguous"]
    if caps.get("strided_grads", True):
        kinds.append("strided")
    if caps.get("expanded_grads", True):
        kinds.append("expanded")
    return st.sampled_from(kinds)


def upstream_classes() -> tuple:
    return (cls("contiguous", lambda p, c: c == "contiguous"),
            cls("strided", lambda p, c: c == "strided", "strided_grads"),
            cls("expanded (stride 0)", lambda p, c: c == "expanded", "expanded_grads"))


def lay_out_upstream(values: torch.Tensor, kind: str) -> torch.Tensor:
    """An upstream gradient of `values`' shape in layout `kind`: contiguous; strided (every other element of a
    buffer twice as wide in the last dim, so that no stride is 1, with its leading dims reversed in memory);
    expanded (the first dim of size > 1 broadcast from one row, stride 0: the values then repeat along it)."""
    if kind == "contiguous" or values.dim() == 0:
        return values.contiguous()
    if kind == "strided":
        n = values.dim()
        order = tuple(reversed(range(n - 1))) + (n - 1,)
        shape = [values.shape[i] for i in order]
        shape[-1] *= 2
        buf = torch.full(shape, float("nan"), dtype=values.dtype, device=values.device)
        view = buf.permute([order.index(i) for i in range(n)])[..., ::2]
        view.copy_(values)
        return view
    dim = next((i for i, n in enumerate(values.shape) if n > 1), None)
    if dim is None:
        return values.contiguous()
    return values.narrow(dim, 0, 1).clone().expand(values.shape)


# -------------------------------------------------------------------------------------------------- queries
def domain(conv) -> dict:
    """The declared domain, with the upstream gradients' classes for a differentiable convention."""
    out = dict(conv.DOMAIN)
    if conv.DIFFERENTIABLE:
        out["upstream gradients"] = upstream_classes()
    return out


def declared_off(conv, caps) -> list:
    """'argument: class (capability)' for every declared class the capabilities in force switch off: what a
    certification with these capabilities does not cover."""
    return [f"{arg}: {c.name} ({c.cap or 'capabilities'})" for arg, classes in domain(conv).items()
            for c in classes if c.off(caps)]


def classes_of(conv, plan, caps, upstream: str = None) -> dict:
    """{argument: the names of its declared classes this plan drew} (the case is built on the CPU, no call)."""
    from ..run import make_case

    case = make_case(conv, caps, plan, torch.device("cpu"))
    out = {}
    for arg, classes in domain(conv).items():
        if arg == "upstream gradients":
            out[arg] = tuple(c.name for c in classes if upstream is not None and c.holds(plan, upstream))
        else:
            out[arg] = tuple(c.name for c in classes if c.holds(plan, case))
    return out
