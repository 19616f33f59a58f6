"""Helpers for tests that run monarch-sky for real: the CLI, Monarch, TorchFT, TorchTitan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    returncode: int
    output: str
    path: Path
    leftovers: list[str]

    @property
    def summary(self) -> dict:
        return json.loads((self.path / "summary.json").read_text())

    @property
    def events(self) -> list[dict]:
        lines = (self.path / "events.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def cli_env() -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env.pop("WANDB_API_KEY", None)
    return env


def train(tmp_path: Path, *overrides: str, timeout_s: float = 600) -> Run:
    """Run `monarch-sky train` to completion and report what it left running."""
    run_id = f"t{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    before = {p.pid for p in psutil.process_iter()}
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_sky", "train", f"run_dir={tmp_path}", f"run_id={run_id}", *overrides],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return Run(proc.returncode, proc.stdout + proc.stderr, tmp_path / run_id, leftovers(before))


def leftovers(before: set[int], grace_s: float = 10.0) -> list[str]:
    """Processes started since `before` that are still alive (after a short grace period)."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
            if p.pid in before or p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.info["ppid"] in (0, 2):  # kernel threads come and go on their own
                continue
            alive.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path
