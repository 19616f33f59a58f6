"""`make bench-heal` at its smallest: every transport moves a rank-shaped state between real
processes bit for bit, and each rate is reported against the raw ceiling of the same run."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, cli_env


def test_every_transport_heals_bit_for_bit_and_is_compared_to_the_raw_ceiling(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "monarch_sky.bench.heal", "--gb", "0.02", "--out", str(tmp_path),
                           "--timeout-s", "60"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench-heal.json").read_text())
    rows = {r["transport"]: r for r in result["rows"]}
    assert set(rows) == {"raw x1", "raw", "tcp", "tcp x2", "rdma", "http", "pg_gloo"}
    for kind, row in rows.items():
        assert row["equal"] is True, (kind, row)
        assert row["bytes"] >= 0.9 * 0.02e9 and row["gb_per_s"] > 0 and row["vs_raw"] > 0, (kind, row)
    assert max(rows["raw"]["vs_raw"], rows["raw x1"]["vs_raw"]) == 1.0
    assert all(rows[k]["pause_s"] >= 0 for k in ("tcp", "tcp x2", "rdma", "http", "pg_gloo"))
    for kind in ("tcp", "tcp x2", "rdma", "http", "pg_gloo"):  # the memory each side held, as a multiple of the state
        assert rows[kind]["sender_peak_x"] >= 0 and rows[kind]["receiver_peak_x"] >= 0, (kind, rows[kind])
    assert "| 0.02 | tcp |" in proc.stdout and (tmp_path / "heal.png").stat().st_size > 0
    report = subprocess.run([sys.executable, "-m", "monarch_sky", "report", str(tmp_path)], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "| 0.02 | tcp |" in report.stdout, report.stderr


def test_an_unknown_transport_is_refused_by_name(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "monarch_sky.bench.heal", "--transports", "tcp,nccl",
                           "--out", str(tmp_path)], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--transports: unknown nccl" in proc.stderr, proc.stderr
    assert not (tmp_path / "bench-heal.json").exists()


def test_a_size_this_machine_cannot_hold_is_skipped_with_a_line_not_run_to_an_oom_kill(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "monarch_sky.bench.heal", "--gb", "100000", "--out", str(tmp_path)],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "100000.00 GB  skipped" in proc.stdout, proc.stdout
    rows = json.loads((tmp_path / "bench-heal.json").read_text())["rows"]
    assert [r["error"] for r in rows] == [rows[0]["error"]] and rows[0]["error"].startswith("skipped"), rows
