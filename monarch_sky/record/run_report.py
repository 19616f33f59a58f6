"""One run's report (`monarch-sky report RUN_DIR`, and at the end of every run): report.md and
timeline.png from the run's records.

A **run dir** (one `monarch-sky train` run) holds `summary.json`, `steps.jsonl` and
`events.jsonl` (`{t, wall, event, ...}`; `fault_injected` events carry kind and replica).
Its time zero is the first event's `wall - t` (the controller's start); without events, the
first step line's `wall - seconds`. The "run step" plotted is the highest step committed so far
(committed lines only), so a restart from a checkpoint shows as a flat stretch, never a drop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from monarch_sky.record.charts import (DPI, FIG_SIZE, NULL, add_kind_legend, fmt_plain, fmt_seconds, mark_faults,
                                       md_table, participants_curve, run_step_curve, save)
from monarch_sky.record.jsonl import read_jsonl


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


def run_report(run_dir: Path) -> tuple[str, list[Path]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    markdown = run_markdown(summary)
    (run_dir / "report.md").write_text(markdown)
    events, steps = read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "steps.jsonl")
    return markdown, [plot_run_timeline(run_dir, events, steps)]


def render_run(run_dir: Path) -> str:
    """Write report.md and timeline.png for one run; return the markdown."""
    return run_report(Path(run_dir))[0]
