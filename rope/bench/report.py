"""Output of a run: the table (markdown, printed and saved), the targets, JSON, and PNG plots."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .machine import describe
from .shapes import THD_PAIRS

# The targets (ratios within one run).
LARGE_MIN_FRAC = 0.95  # forward and backward, of the copy bandwidth
SMALL_GRAPH_SLACK_US = 0.3  # inside a CUDA graph, over clone of the same tensor
HOST_LIMITS = {"fwd_us": 1.0, "fwd_grad_us": 1.5, "bwd_us": 1.5}  # host cost per call, x clone's
THD_MAX_RATIO = 1.05  # packed short sequences vs bshd with the same tokens
QK_MAX_RATIO = 1.0  # q and k in one call must beat two single calls: time strictly below theirs

COLUMNS = ["case", "shape", "dtype", "format", "impl", "fwd µs", "fwd GB/s", "fwd %copy", "bwd µs", "bwd GB/s",
           "bwd %copy", "host µs/call fwd·grad·bwd", "clone µs", "clone host µs", "note"]


def _us(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _num(v, fmt):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


def _row_cells(r):
    f, b, h, c = r.get("fwd"), r.get("bwd"), r.get("host"), r.get("clone", {})
    note = r.get("reason", "") if r["status"] != "ok" else ""
    if r["status"] != "ok":
        note = f"{r['status']}: {note}"
    if r.get("impl_note"):  # how the implementation was run (two calls, in place)
        note = r["impl_note"] + (f"; {note}" if note else "")
    for name, t in (("fwd", f), ("bwd", b)):
        if t and t.get("method") == "events":  # a GPU run that could not use a graph
            why = f" ({t['note']})" if t.get("note") else ""
            note += f"{'; ' if note else ''}{name} timed by {t['method']}{why}"
    host = "-"
    if h:
        host = " · ".join(_us(h[k]) for k in ("fwd_us", "fwd_grad_us", "bwd_us"))
    return [
        r["case"], r["label"], r["dtype"], r["format"], r["impl"],
        _us(f and f["us"]), _num(f and f["gbps"], ".0f"), _num(f and 100 * f["frac_copy"], ".1f"),
        _us(b and b["us"]), _num(b and b["gbps"], ".0f"), _num(b and 100 * b["frac_copy"], ".1f"),
        host, _us(c.get("us")), _us(c.get("host_us")), note,
    ]


def markdown_table(results: dict) -> str:
    rows = [COLUMNS] + [_row_cells(r) for r in results["results"]]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(COLUMNS))]

    def line(cells):
        return "| " + " | ".join(str(v).ljust(w) for v, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(rows[0]), sep] + [line(r) for r in rows[1:]])


def _ok(r):
    return r is not None and r["status"] == "ok"


def _against_clone(r, d) -> str:
    """A copy target's context: `clone` of the same tensor(s) moves the same bytes, so its fraction of
    the 1 GiB copy is what any kernel can reach at this size (launch, ramp and tail included)."""
    clone = r.get("clone") or {}
    if clone.get("method") != "graph" or r[d].get("method") != "graph" or not clone.get("us"):
        return ""
    return (f"clone {r[d]['frac_copy'] * r[d]['us'] / clone['us']:.1%} of copy; "
            f"{clone['us'] / r[d]['us']:.1%} of clone's speed")


def evaluate_targets(results: dict) -> list:
    """The issue's targets for `ours` (and `ours_qk` on the qk cases), each with the measured value, the
    limit and the verdict."""
    out = []
    ours = {r["case"]: r for r in results["results"] if r["impl"] == "ours"}

    def add(target, case, value, limit, ok, detail=""):
        out.append({"target": target, "case": case, "value": value, "limit": limit, "ok": bool(ok),
                    "detail": detail})

    for name, r in ours.items():
        if not _ok(r):
            continue
        if r["large"]:
            for d in ("fwd", "bwd"):
                v = r[d]["frac_copy"]
                add(f"large {d} >= {LARGE_MIN_FRAC:.0%} of copy", name, v, LARGE_MIN_FRAC, v >= LARGE_MIN_FRAC,
                    _against_clone(r, d))
        if r["small"]:
            clone = r["clone"]
            for d in ("fwd", "bwd"):
                if r[d]["method"] == "graph" and clone["method"] == "graph":
                    v = r[d]["us"] - clone["us"]
                    add(f"small {d} in a graph <= clone + {SMALL_GRAPH_SLACK_US} µs", name, v,
                        SMALL_GRAPH_SLACK_US, v <= SMALL_GRAPH_SLACK_US,
                        f"{r[d]['us']:.2f} µs vs clone {clone['us']:.2f} µs")
            if r.get("host") and clone.get("host_us"):
                for key, limit in HOST_LIMITS.items():
                    # The ratio taken in rounds alternating with clone's where the run has it (host
                    # load drifts between separate measurements), else the two separate costs'.
                    v = r["host"].get(key.replace("_us", "_x_clone")) or r["host"][key] / clone["host_us"]
                    floor = clone.get("bwd_host_us") if key == "bwd_us" else None
                    floor_x = clone.get("bwd_host_x_clone") if floor else None
                    add(f"small host {key.replace('_us', '')} <= {limit}x clone", name, v, limit, v <= limit,
                        f"{r['host'][key]:.1f} µs; clone {clone['host_us']:.1f} µs measured apart"
                        + (f"; autograd.grad through a clone alone: {floor:.1f} µs" if floor else "")
                        + (f", {floor_x:.2f}x clone" if floor_x else ""))
    for thd, bshd in THD_PAIRS:
        a, b = ours.get(thd), ours.get(bshd)
        if _ok(a) and _ok(b):
            for d in ("fwd", "bwd"):
                v = a[d]["us"] / b[d]["us"]
                add(f"thd {d} <= {THD_MAX_RATIO}x bshd, same tokens", f"{thd} vs {bshd}", v, THD_MAX_RATIO,
                    v <= THD_MAX_RATIO, f"{a[d]['us']:.1f} µs vs {b[d]['us']:.1f} µs")
    for r in results["results"]:
        if r["impl"] != "ours_qk" or not _ok(r):
            continue
        name = r["case"]
        if r.get("qk_headline"):
            for d in ("fwd", "bwd"):
                v = r[d]["frac_copy"]
                add(f"qk {d} >= {LARGE_MIN_FRAC:.0%} of copy counting both tensors", name, v, LARGE_MIN_FRAC,
                    v >= LARGE_MIN_FRAC, _against_clone(r, d))
        two = next((x for x in results["results"] if x["case"] == name and x["impl"] == "ours_2x"), None)
        if _ok(two):
            for d in ("fwd", "bwd"):
                v = r[d]["us"] / two[d]["us"]
                add(f"qk {d} faster than two single calls", name, v, QK_MAX_RATIO, v < QK_MAX_RATIO,
                    f"ours_qk {r[d]['us']:.1f} µs vs ours_2x {two[d]['us']:.1f} µs")
    return out


def targets_text(targets: list) -> str:
    if not targets:
        return "targets: none applicable to the selected cases"
    lines = ["targets (ours, ratios from this run):"]
    for t in targets:
        v = t["value"]
        shown = f"{v:.1%}" if "copy" in t["target"] else f"{v:.3g}"
        lines.append(f"  {'PASS' if t['ok'] else 'MISS'}  {t['target']:<45} {t['case']:<28} {shown:>9}"
                     + (f"  ({t['detail']})" if t["detail"] else ""))
    return "\n".join(lines)


def header_text(results: dict) -> str:
    m = results["meta"]
    return (f"{describe(m)}\ncopy bandwidth: {m['copy_gbps']:.0f} GB/s ({m['copy_bytes'] / 2**30:g} GiB "
            f"device-to-device copy, bytes read + written)\ncommand: {m.get('command', '?')}")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_json(results: dict, path: Path):
    path.write_text(json.dumps(_clean(results), indent=1) + "\n")


def plot_sweep(results: dict, out_dir: Path) -> list:
    """GB/s and % of copy against sequence length, forward and backward (one PNG each).

    Returns the files written; raises ImportError without matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["results"] if r["sweep"] and _ok(r)]
    if not rows:
        return []
    copy = results["meta"]["copy_gbps"]
    by_s = sorted(rows, key=lambda r: r["seq_len"])
    what = f"{by_s[0]['format']} {by_s[0]['dtype']}, {by_s[0]['label']} ... {by_s[-1]['label']}"
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    files = []
    for d, title in (("fwd", "forward"), ("bwd", "backward")):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for impl in impls:
            pts = sorted((r["seq_len"], r[d]["gbps"], 100 * r[d]["frac_copy"]) for r in rows if r["impl"] == impl)
            xs = [p[0] for p in pts]
            ax1.plot(xs, [p[1] for p in pts], marker="o", label=impl)
            ax2.plot(xs, [p[2] for p in pts], marker="o", label=impl)
        ax1.axhline(copy, color="gray", linestyle="--", linewidth=1, label=f"copy {copy:.0f} GB/s")
        ax2.axhline(100, color="gray", linestyle="--", linewidth=1, label="copy")
        for ax, ylabel in ((ax1, "GB/s (bytes read + written)"), (ax2, "% of copy bandwidth")):
            ax.set_xscale("log", base=2)
            ticks = sorted({r["seq_len"] for r in rows})
            ax.set_xticks(ticks, [str(v) for v in ticks])
            ax.minorticks_off()
            ax.set_xlabel("sequence length s")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        ax2.set_ylim(bottom=0)
        fig.suptitle(f"RoPE {title}: {what}\n{describe(results['meta'])}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"sweep_{d}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files
