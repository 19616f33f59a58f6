"""Ctrl-C stops every process the run started, promptly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from conftest import REPO, cli_env, leftovers, new_tag


def wait_for_event(path, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if any(e["event"] == name for e in events):
                return
        time.sleep(0.5)
    raise AssertionError(f"no {name} event within {timeout_s}s")


def test_ctrl_c_stops_every_process(tmp_path):
    tag = new_tag()
    proc = subprocess.Popen(
        [sys.executable, "-m", "monarch_sky", "train", f"run_dir={tmp_path}", "run_id=ctrlc",
         "replicas=2", "steps=10000", "faults=none", "ft.standby=false"],
        cwd=REPO, env=cli_env(tag), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_for_event(tmp_path / "ctrlc" / "events.jsonl", "training_started", timeout_s=300)
        time.sleep(3)  # mid-training
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output
    assert leftovers(tag) == []
