"""What the run report and the bench report both draw with: number formats, markdown tables,
step curves over wall time and fault markers on them."""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # renders through Agg when saved as PNG; no pyplot, no display

NULL = "—"
FIG_SIZE = (9, 5)
DPI = 100
FAULT_MARKERS = ["X", "v", "s", "D", "^", "P", "*"]


def fmt_seconds(value: float | None) -> str:
    return NULL if value is None else f"{value:.2f}"


def fmt_ratio(value: float | None) -> str:
    return NULL if value is None else f"{value:.3f}"


def fmt_plain(value: Any) -> str:
    return NULL if value is None else str(value)


def run_step_curve(steps: list[dict[str, Any]], zero: float) -> tuple[list[float], list[int]]:
    """(seconds since zero, highest committed step so far) at each committed line."""
    xs, ys, best = [], [], 0
    for line in sorted((s for s in steps if s.get("committed")), key=lambda s: s["wall"]):
        best = max(best, line["step"])
        xs.append(line["wall"] - zero)
        ys.append(best)
    return xs, ys


def participants_curve(steps: list[dict[str, Any]], zero: float) -> tuple[list[float], list[int]]:
    """(seconds since zero, participants) at each committed line."""
    committed = sorted((s for s in steps if s.get("committed")), key=lambda s: s["wall"])
    return [s["wall"] - zero for s in committed], [s.get("participants", 0) for s in committed]


def height_at(xs: list[float], ys: list[int], x: float) -> int:
    """A step curve's value at x (0 before its first point)."""
    i = bisect_right(xs, x)
    return ys[i - 1] if i else 0


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows)]



def new_axes(title: str, ylabel: str):
    fig = Figure(figsize=FIG_SIZE, dpi=DPI)
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def mark_faults(ax, faults: list[dict[str, Any]], zero: float, curve: tuple[list, list], color, kinds: list[str]) -> None:
    """A marker on the curve at each fault's time; the marker's shape says its kind."""
    for fault in faults:
        kind = fault.get("kind", "?")
        if kind not in kinds:
            kinds.append(kind)
        x = fault["wall"] - zero
        marker = FAULT_MARKERS[kinds.index(kind) % len(FAULT_MARKERS)]
        ax.plot([x], [height_at(*curve, x)], marker=marker, color=color, markersize=9,
                markeredgecolor="black", linestyle="none")


def add_kind_legend(ax, kinds: list[str]) -> None:
    """Grey legend entries for the fault kinds' marker shapes."""
    for i, kind in enumerate(kinds):
        ax.plot([], [], marker=FAULT_MARKERS[i % len(FAULT_MARKERS)], color="grey", linestyle="none",
                label=f"fault: {kind}")


def save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
