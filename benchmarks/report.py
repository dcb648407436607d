"""The peer table and plots from the JSON of a benchmark run (pytest --benchmark-json=FILE).

    python benchmarks/report.py FILE --out DIR

DIR/table.md: case x implementation x mode, with the eager and the GPU (CUDA-graph replay) time per
call, GB/s and % of the copy bandwidth, and both times over clone's of the same case in the same run.
GB/s and % of copy come from the GPU time where there is one, else from the eager time (marked *).
DIR/copy_<mode>.png: % of the copy bandwidth per case, one bar per implementation.
DIR/mrope.md, where the run has bench_mrope.py's results: per mode, tokens T x implementation, each cell GPU µs,
% of copy and the ratio to clone of the same T (eager where a peer was not captured, marked *).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
from tqdm import tqdm

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = ["case", "shape", "impl", "mode", "µs", "GPU µs", "GB/s", "% copy", "x clone", "GPU x clone"]


def _num(value):
    return "-" if value is None else f"{value:.2f}"


def speed(row) -> tuple[float, float, str]:
    """GB/s, fraction of copy, and "" from the GPU time, or "*" from the eager time where there is none."""
    if row["gpu_us"]:
        return row["gpu_gbps"], row["gpu_frac_copy"], ""
    return row["gbps"], row["frac_copy"], "*"


def table(machine: dict, rows: list) -> str:
    copy = f"{rows[0]['copy_gbps']:.0f}" if rows else "?"
    lines = [f"{machine.get('gpu', {}).get('name', '?')}; torch {machine.get('torch', '?')}, triton "
             f"{machine.get('triton', '?')}; copy bandwidth {copy} GB/s (bytes read + written)", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        gbps, frac, mark = speed(r)
        cells = [r["case"], r["label"], r["impl"], r["mode"], _num(r["us"]), _num(r["gpu_us"]), f"{gbps:.0f}{mark}",
                 f"{100 * frac:.1f}{mark}", _num(r["x_clone"]), _num(r["gpu_x_clone"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mrope_table(machine: dict, rows: list) -> str:
    """bench_mrope.py's rows (extra_info suite "mrope"): one table per mode, a row per T, a column per
    implementation; clone (forward only) is the first column of every mode's table."""
    copy = f"{rows[0]['copy_gbps']:.0f}" if rows else "?"
    lines = [f"{machine.get('gpu', {}).get('name', '?')}; torch {machine.get('torch', '?')}, triton "
             f"{machine.get('triton', '?')}; copy bandwidth {copy} GB/s (bytes read + written)", "",
             f"T tokens (T = {rows[0]['tokens']}: {rows[0]['label']}). Each cell: GPU µs per call / % of copy / "
             "time over clone's of the same T (*: eager time, the calls were not captured)", ""]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    tokens = list(dict.fromkeys(r["tokens"] for r in rows))
    by_key = {(r["tokens"], r["impl"], r["mode"]): r for r in rows}
    for mode in dict.fromkeys(r["mode"] for r in rows if r["impl"] != "clone"):
        cols = [i for i in impls if any((t, i, "fwd" if i == "clone" else mode) in by_key for t in tokens)]
        lines += [f"### {mode}", "", "| T | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for t in tokens:
            cells = []
            for impl in cols:
                r = by_key.get((t, impl, "fwd" if impl == "clone" else mode))
                if r is None:
                    cells.append("-")
                    continue
                _, frac, mark = speed(r)
                us, x_clone = (r["gpu_us"], r["gpu_x_clone"]) if r["gpu_us"] else (r["us"], r["x_clone"])
                cells.append(f"{us:.2f}{mark} / {100 * frac:.1f} % / {_num(x_clone)}")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines.append("")
    for impl, what in dict.fromkeys((r["impl"], r.get(key)) for r in rows for key in ("source", "note") if r.get(key)):
        lines.append(f"- {impl}: {what}")
    for r in rows:
        if r.get("capture_error"):
            lines.append(f"- T {r['tokens']} {r['impl']} {r['mode']}: not captured, {r['capture_error']}")
    return "\n".join(lines) + "\n"


def plot(rows: list, mode: str, path: Path) -> None:
    """Horizontal bars, % of copy: one group per case, one bar and colour per implementation that ran it."""
    colors = {impl: f"C{i}" for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows))}  # alike in every plot
    rows = [r for r in rows if r["mode"] == mode]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.2 * len(rows) + 0.15 * len(cases)))
    y, ticks = 0.0, []
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        ticks.append(y + (len(mine) - 1) / 2)
        for r in mine:
            ax.barh(y, 100 * speed(r)[1], color=colors[r["impl"]], label=r["impl"])
            y += 1
        y += 0.7  # between cases
    ax.axvline(100, color="gray", linestyle="--", linewidth=1)
    ax.set_yticks(ticks, cases)
    ax.invert_yaxis()
    ax.set_xlabel("% of copy bandwidth (GPU time; eager where none)")
    ax.set_title(f"RoPE {mode}")
    ax.grid(True, axis="x", alpha=0.3)
    handles = dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))  # one entry per implementation
    ax.legend(handles.values(), handles.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="the file of --benchmark-json")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default: bench-out/)")
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    rows = [b["extra_info"] for b in data["benchmarks"] if "us" in b["extra_info"]]  # timed ones, in run order
    args.out.mkdir(parents=True, exist_ok=True)
    written = [args.out / "table.md"]
    written[0].write_text(table(data.get("machine_info", {}), rows))
    mrope = [r for r in rows if r.get("suite") == "mrope"]
    if mrope:
        written.append(args.out / "mrope.md")
        written[-1].write_text(mrope_table(data.get("machine_info", {}), mrope))
    for mode in tqdm(list(dict.fromkeys(r["mode"] for r in rows)), desc="plots"):
        written.append(args.out / f"copy_{mode.replace('+', '_')}.png")
        plot(rows, mode, written[-1])
    print("wrote " + ", ".join(map(str, written)))
    return written


if __name__ == "__main__":
    main()
