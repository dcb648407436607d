"""The peer table and plots from the JSON of a benchmark run (pytest --benchmark-json=FILE).

    python benchmarks/report.py FILE --out DIR

DIR/table.md: case x implementation x mode, with the eager and the GPU (CUDA-graph replay) time per
call, GB/s and % of the copy bandwidth, and both times over clone's of the same case in the same run.
GB/s and % of copy come from the GPU time where there is one, else from the eager time (marked *).
DIR/copy_<mode>.png: % of the copy bandwidth per case, one bar per implementation.
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
    for mode in tqdm(list(dict.fromkeys(r["mode"] for r in rows)), desc="plots"):
        written.append(args.out / f"copy_{mode.replace('+', '_')}.png")
        plot(rows, mode, written[-1])
    print("wrote " + ", ".join(map(str, written)))
    return written


if __name__ == "__main__":
    main()
