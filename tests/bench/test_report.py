"""The report renderer on synthetic bench and run records: files written, PNGs valid, tables whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from monarch_sky.bench.report import render, render_bench
from monarch_sky.record.charts import fmt_ratio, fmt_seconds, run_step_curve
from monarch_sky.record.run_report import render_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def step_lines(replicas: int, steps: int, restart_at: int | None = None) -> list[dict]:
    """Interleaved lines from `replicas` groups; after `restart_at`, steps 3.. are done again."""
    lines, wall = [], T0 + 1.0
    numbers = list(range(1, steps + 1))
    if restart_at is not None:
        numbers = numbers[:restart_at] + list(range(3, steps + 1))
    for step in numbers:
        for replica in range(replicas):
            wall += 0.5
            lines.append({"wall": wall, "replica": replica, "step": step, "committed": step != 2,
                          "seconds": 0.5, "loss": 5.0 - step * 0.1, "participants": replicas - (step == 5)})
    return lines


def fault_stats() -> dict:
    return {"count": 1, "detected_s": {"median": 1.25, "max": 1.5},
            "resumed_s": {"median": 2.0, "max": None}, "rejoined_s": {"median": None, "max": None}}


def arm(label: str, folder: str) -> dict:
    return {"label": label, "dir": folder, "started_wall": T0, "wall_s": 12.3456, "committed_steps": 10,
            "attempted_steps": 12, "step_efficiency": 0.8333, "goodput": None, "time_to_target_s": 11.0,
            "loss_at_target": 4.0, "median_step_s": 0.5, "exit_code": 0, "faults": {"kill": fault_stats()}}


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    arms = {"A_step": arm("A: monarch-sky, no faults (step)", "a_step"), "B": arm("B: baseline", "b"),
            "C": arm("C: monarch-sky, faults", "c")}
    ratios = {"goodput C/D": 1.234567, "step_time A_step/B": None}
    bench = {"bench_id": "b1", "created": "2025-01-01T00:00:00", "settings": {"steps": 10, "replicas": 2},
             "arms": arms, "ratios": ratios}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    for key, spec in arms.items():
        folder = tmp_path / spec["dir"]
        folder.mkdir()
        write_jsonl(folder / "steps.jsonl", step_lines(2, 10, restart_at=6 if key == "C" else None))
        if key != "B":  # B has no faults file at all
            write_jsonl(folder / "faults.jsonl", [{"wall": T0 + 5.0, "kind": "kill", "replica": 1}])
    return tmp_path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "run-1"
    folder.mkdir()
    summary = {"run_id": "run-1", "target_steps": 10, "committed_steps": 10, "wall_s": 9.87,
               "outcome": {"exit_code": 0, "status": "ok", "reasons": []},
               "faults": [{"kind": "kill", "replica": 1, "step": 4, "rank": 0, "detected_s": 0.4,
                           "survivors_resumed_s": 1.2, "rejoined_s": None, "recovered_from": "peer",
                           "steps_while_down": 2}]}
    (folder / "summary.json").write_text(json.dumps(summary))
    write_jsonl(folder / "steps.jsonl", step_lines(2, 10))
    write_jsonl(folder / "events.jsonl", [
        {"t": 0.0, "wall": T0, "event": "run_started"},
        {"t": 4.0, "wall": T0 + 4.0, "event": "fault_injected", "kind": "kill", "replica": 1, "rank": 0, "step": 4}])
    return folder


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5_000, f"{path} is only {len(data)} bytes"


def table_rows(markdown: str, first_cell_prefix: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith(f"| {first_cell_prefix}")]


def test_bench_writes_markdown_and_plots(bench_dir: Path) -> None:
    markdown = render_bench(bench_dir)
    assert (bench_dir / "bench.md").read_text() == markdown
    arms = json.loads((bench_dir / "bench.json").read_text())["arms"]
    section = markdown.split("## Faults")[0]
    for spec in arms.values():
        assert len(table_rows(section, spec["label"])) == 1
    assert "| 10/10 |" in markdown and "12.35" in markdown and "0.833" in markdown
    for name in ("goodput C/D", "step_time A_step/B"):
        assert name in markdown
    assert "goodput C/D: 1.235" in markdown and "step_time A_step/B: —" in markdown
    for png in ("steps_vs_time.png", "quorum_C.png"):
        assert_png(bench_dir / png)


def test_render_picks_bench(bench_dir: Path) -> None:
    markdown, pngs = render(bench_dir)
    assert markdown.startswith("# Benchmark b1")
    assert sorted(p.name for p in pngs) == ["quorum_C.png", "steps_vs_time.png"]


def test_run_writes_report_and_timeline(run_dir: Path) -> None:
    markdown = render_run(run_dir)
    assert (run_dir / "report.md").read_text() == markdown
    assert "10/10" in markdown and "9.87" in markdown and "ok" in markdown
    assert len(table_rows(markdown, "kill")) == 1 and "peer" in markdown
    markdown2, pngs = render(run_dir)
    assert markdown2 == markdown and [p.name for p in pngs] == ["timeline.png"]
    assert_png(run_dir / "timeline.png")


def test_render_empty_dir_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        render(tmp_path)


def test_run_step_never_drops_after_a_restart() -> None:
    _, ys = run_step_curve(step_lines(1, 10, restart_at=6), T0)
    assert ys == sorted(ys) and ys[-1] == 10


def test_number_formats() -> None:
    assert (fmt_seconds(1.234), fmt_seconds(None), fmt_ratio(0.12345), fmt_ratio(None)) == ("1.23", "—", "0.123", "—")
