"""Render a benchmark's (or one run's) records as a markdown report and PNG plots.

Reads, never writes, the records; writes only the report files next to them.

A **bench dir** holds `bench.json` (`bench_id`, `settings` with `steps` = the target,
`arms` = {key: {label, dir, started_wall, wall_s, committed_steps, step_efficiency, goodput,
work_rate, time_to_target_s, loss_at_target, median_step_s, faults: {kind: {count, detected_s, resumed_s,
rejoined_s: {median, max}}}}}, `ratios` = {name: float|null}, `ratio_spread` = {name:
{median, min, max, rounds}|null}) and one folder per arm with
`steps.jsonl` (`{wall, replica, step, committed, seconds, loss, participants}` per line) and
`faults.jsonl` (`{wall, kind, replica}` per injected fault; may be missing). An arm's time
zero is its `started_wall`. Writes `bench.md`, `steps_vs_time.png` and, when an arm "C"
exists, `quorum_C.png`.

A **run dir** (one `monarch-sky train` run) holds `summary.json`, `steps.jsonl` and
`events.jsonl` (`{t, wall, event, ...}`; `fault_injected` events carry kind and replica).
Its time zero is the first event's `wall - t` (the controller's start); without events, the
first step line's `wall - seconds`. Writes `report.md` and `timeline.png`.

The "run step" plotted is the highest step committed so far (committed lines only), so a
restart from a checkpoint shows as a flat stretch, never a drop.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # renders through Agg when saved as PNG; no pyplot, no display
from matplotlib.ticker import MaxNLocator

from monarch_sky.bench.metrics import read_jsonl

NULL = "—"
FIG_SIZE = (9, 5)
DPI = 100
FAULT_MARKERS = ["X", "v", "s", "D", "^", "P", "*"]
QUORUM_ARM = "C"


# ---- number formatting -------------------------------------------------------------------

def fmt_seconds(value: float | None) -> str:
    return NULL if value is None else f"{value:.2f}"


def fmt_ratio(value: float | None) -> str:
    return NULL if value is None else f"{value:.3f}"


def fmt_spread(spread: dict | None) -> str:
    """ (min-max over N rounds), when there was more than one round."""
    if not spread or len(spread.get("rounds") or []) < 2:
        return ""
    return f" (min {spread['min']:.3f}, max {spread['max']:.3f} over {len(spread['rounds'])} rounds)"


def fmt_plain(value: Any) -> str:
    return NULL if value is None else str(value)


# ---- reading records ---------------------------------------------------------------------

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


# ---- markdown ----------------------------------------------------------------------------

def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows)]


def arm_row(arm: dict[str, Any], target: Any) -> list[str]:
    return [
        arm.get("label", ""),
        fmt_seconds(arm.get("wall_s")),
        f"{fmt_plain(arm.get('committed_steps'))}/{fmt_plain(target)}",
        fmt_ratio(arm.get("step_efficiency")),
        fmt_ratio(arm.get("goodput")),
        fmt_ratio(arm.get("work_rate")),
        fmt_seconds(arm.get("time_to_target_s")),
        fmt_ratio(arm.get("loss_at_target")),
        fmt_seconds(arm.get("median_step_s")),
    ]


def fault_rows(arm: dict[str, Any]) -> list[list[str]]:
    rows = []
    for kind, stats in (arm.get("faults") or {}).items():
        cells = [arm.get("label", ""), kind, fmt_plain(stats.get("count"))]
        for phase in ("detected_s", "resumed_s", "rejoined_s"):
            spread = stats.get(phase) or {}
            cells += [fmt_seconds(spread.get("median")), fmt_seconds(spread.get("max"))]
        rows.append(cells)
    return rows


def bench_markdown(bench: dict[str, Any]) -> str:
    arms = bench.get("arms", {})
    target = (bench.get("settings") or {}).get("steps")
    lines = [f"# Benchmark {bench.get('bench_id', '')}", "", f"Created {bench.get('created', NULL)}; "
             f"settings: `{json.dumps(bench.get('settings') or {}, sort_keys=True)}`", "", "## Arms", ""]
    lines += md_table(["arm", "wall s", "committed/target", "step efficiency", "goodput",
                       "work rate /s", "time to target s", "loss at target", "median step s"],
                      [arm_row(arm, target) for arm in arms.values()])
    rows = [row for arm in arms.values() for row in fault_rows(arm)]
    lines += ["", "## Faults", ""]
    lines += md_table(["arm", "kind", "count", "detected median s", "detected max s", "resumed median s",
                       "resumed max s", "rejoined median s", "rejoined max s"], rows) if rows else ["No faults."]
    lines += ["", "## Ratios", ""]
    spreads = bench.get("ratio_spread") or {}
    lines += [f"- {name}: {fmt_ratio(value)}{fmt_spread(spreads.get(name))}"
              for name, value in (bench.get("ratios") or {}).items()] or ["None."]
    excluded = [f"- {arm.get('label', key)}: {', '.join(arm['excluded_faults']['kinds'])} left out "
                f"(its stack cannot see them; draws skipped: {arm['excluded_faults']['skipped'] or 0})"
                for key, arm in arms.items() if arm.get("excluded_faults")]
    if excluded:
        lines += ["", "## Fault kinds left out", "", *excluded]
    return "\n".join(lines) + "\n"


def run_markdown(summary: dict[str, Any]) -> str:
    outcome = summary.get("outcome") or {}
    lines = [f"# Run {summary.get('run_id', '')}", "",
             f"- committed/target steps: {fmt_plain(summary.get('committed_steps'))}/{fmt_plain(summary.get('target_steps'))}",
             f"- wall s: {fmt_seconds(summary.get('wall_s'))}",
             f"- outcome: {outcome.get('status', NULL)} (exit {fmt_plain(outcome.get('exit_code'))})"]
    lines += [f"  - {reason}" for reason in outcome.get("reasons") or []]
    faults = summary.get("faults") or []
    rows = [[f.get("kind", ""), fmt_plain(f.get("replica")), fmt_plain(f.get("step")),
             fmt_seconds(f.get("detected_s")), fmt_seconds(f.get("survivors_resumed_s")),
             fmt_seconds(f.get("rejoined_s")), fmt_plain(f.get("recovered_from"))] for f in faults]
    lines += ["", "## Faults", ""]
    lines += md_table(["kind", "replica", "step", "detected s", "resumed s", "rejoined s", "recovered from"],
                      rows) if rows else ["No faults."]
    return "\n".join(lines) + "\n"


# ---- plots -------------------------------------------------------------------------------

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


def plot_bench_steps(bench_dir: Path, arms: dict[str, Any]) -> Path:
    fig, ax = new_axes("Committed run step over time, per arm", "run step (highest committed)")
    kinds: list[str] = []
    for i, arm in enumerate(arms.values()):
        color = f"C{i % 10}"
        zero = arm.get("started_wall") or 0.0
        curve = run_step_curve(read_jsonl(bench_dir / arm["dir"] / "steps.jsonl"), zero)
        ax.step(*curve, where="post", color=color, label=arm.get("label", arm["dir"]))
        mark_faults(ax, read_jsonl(bench_dir / arm["dir"] / "faults.jsonl"), zero, curve, color, kinds)
    add_kind_legend(ax, kinds)
    ax.set_xlim(left=0)  # from launch: start-up time is part of each arm's cost
    ax.legend(loc="best", fontsize="small")
    return save(fig, bench_dir / "steps_vs_time.png")


def plot_quorum(bench_dir: Path, arm: dict[str, Any], key: str) -> Path:
    fig, ax = new_axes(f"Quorum participants over time: {arm.get('label', key)}", "participants")
    zero = arm.get("started_wall") or 0.0
    curve = participants_curve(read_jsonl(bench_dir / arm["dir"] / "steps.jsonl"), zero)
    ax.step(*curve, where="post", color="C0", label="participants (committed steps)")
    kinds: list[str] = []
    mark_faults(ax, read_jsonl(bench_dir / arm["dir"] / "faults.jsonl"), zero, curve, "C3", kinds)
    add_kind_legend(ax, kinds)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="best", fontsize="small")
    return save(fig, bench_dir / f"quorum_{key}.png")


def run_zero(events: list[dict[str, Any]], steps: list[dict[str, Any]]) -> float:
    """The run's time zero: the controller's start (first event), else the first step's start."""
    if events and "wall" in events[0]:
        return events[0]["wall"] - events[0].get("t", 0.0)
    if steps:
        return steps[0]["wall"] - steps[0].get("seconds", 0.0)
    return 0.0


def plot_run_timeline(run_dir: Path, events: list[dict[str, Any]], steps: list[dict[str, Any]]) -> Path:
    zero = run_zero(events, steps)
    faults = [e for e in events if e.get("event") == "fault_injected" and "wall" in e]
    fig = Figure(figsize=FIG_SIZE, dpi=DPI)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    top.set_title(f"Run {run_dir.name}: committed run step and quorum over time")
    kinds: list[str] = []
    for ax, curve, ylabel, color in ((top, run_step_curve(steps, zero), "run step (highest committed)", "C0"),
                                     (bottom, participants_curve(steps, zero), "participants", "C2")):
        ax.step(*curve, where="post", color=color, label=ylabel)
        mark_faults(ax, faults, zero, curve, "C3", kinds)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    add_kind_legend(top, kinds)
    top.legend(loc="best", fontsize="small")
    bottom.set_xlabel("seconds since start")
    bottom.set_ylim(bottom=0)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    return save(fig, run_dir / "timeline.png")


# ---- entry points ------------------------------------------------------------------------

def bench_report(bench_dir: Path) -> tuple[str, list[Path]]:
    bench = json.loads((bench_dir / "bench.json").read_text())
    arms = bench.get("arms", {})
    markdown = bench_markdown(bench)
    (bench_dir / "bench.md").write_text(markdown)
    pngs = [plot_bench_steps(bench_dir, arms)]
    if QUORUM_ARM in arms:
        pngs.append(plot_quorum(bench_dir, arms[QUORUM_ARM], QUORUM_ARM))
    return markdown, pngs


def run_report(run_dir: Path) -> tuple[str, list[Path]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    markdown = run_markdown(summary)
    (run_dir / "report.md").write_text(markdown)
    events, steps = read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "steps.jsonl")
    return markdown, [plot_run_timeline(run_dir, events, steps)]


def render_bench(bench_dir: Path) -> str:
    """Write bench.md and the bench plots; return the markdown."""
    return bench_report(Path(bench_dir))[0]


def render_run(run_dir: Path) -> str:
    """Write report.md and timeline.png for one run; return the markdown."""
    return run_report(Path(run_dir))[0]


def render(path: Path) -> tuple[str, list[Path]]:
    """Report on a bench dir (bench.json), a heal bench dir (bench-heal.json) or a run dir
    (summary.json): (markdown, PNGs written)."""
    path = Path(path)
    if (path / "bench.json").exists():
        return bench_report(path)
    if (path / "bench-heal.json").exists():
        from monarch_sky.bench import heal

        result = json.loads((path / "bench-heal.json").read_text())
        heal.plot(result, path / "heal.png")
        return heal.table(result), [path / "heal.png"]
    if (path / "summary.json").exists():
        return run_report(path)
    raise ValueError(f"{path}: expected a bench dir (bench.json or bench-heal.json) or a run dir (summary.json); "
                     "found none")
