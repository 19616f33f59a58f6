"""Render a benchmark's records as a markdown report and PNG plots (a run's own report is
`monarch_sky.record.run_report`; `render` takes either).

Reads, never writes, the records; writes only the report files next to them.

A **bench dir** holds `bench.json` (`bench_id`, `settings` with `steps` = the target,
`arms` = {key: {label, dir, started_wall, wall_s, committed_steps, step_efficiency, goodput,
work_rate, time_to_target_s, loss_at_target, median_step_s, first_step_s, between_steps_s, faults: {kind: {count, detected_s, resumed_s,
rejoined_s: {median, max}}}}}, `ratios` = {name: float|null}, `ratio_spread` = {name:
{median, min, max, rounds}|null}) and one folder per arm with
`steps.jsonl` (`{wall, replica, step, committed, seconds, loss, participants}` per line) and
`faults.jsonl` (`{wall, kind, replica}` per injected fault; may be missing). An arm's time
zero is its `started_wall`. Writes `bench.md`, `steps_vs_time.png` and, when an arm "C"
exists, `quorum_C.png`. The "run step" plotted is the highest step committed so far.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from monarch_sky.record.charts import (NULL, add_kind_legend, fmt_plain, fmt_ratio, fmt_seconds, mark_faults,
                                       md_table, new_axes, participants_curve, run_step_curve, save)
from monarch_sky.record.jsonl import read_jsonl
from monarch_sky.record.run_report import run_report

QUORUM_ARM = "C"


def fmt_spread(spread: dict | None) -> str:
    """ (min-max over N rounds), when there was more than one round."""
    if not spread or len(spread.get("rounds") or []) < 2:
        return ""
    return f" (min {spread['min']:.3f}, max {spread['max']:.3f} over {len(spread['rounds'])} rounds)"


# ---- markdown ----------------------------------------------------------------------------

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
        fmt_seconds(arm.get("steady_step_s")),
        fmt_seconds(arm.get("first_step_s")),
        fmt_seconds(arm.get("between_steps_s")),
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
                       "work rate /s", "time to target s", "loss at target", "median step s", "steady step s", "first step s",
                       "between steps s"],
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


# ---- plots -------------------------------------------------------------------------------

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


def render_bench(bench_dir: Path) -> str:
    """Write bench.md and the bench plots; return the markdown."""
    return bench_report(Path(bench_dir))[0]


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
