"""A benchmark arm's processes: start, watch, kill the whole tree, relaunch after a lost host.

A host fault on an arm without Monarch has no replacement host to move to: its job (or
replica group) is killed with everything under it and started again after the same
provisioning delay monarch-sky's local provider gives a replacement host, the way a
scheduler such as Slurm requeues a job whose node died.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil


class Launch:
    """One command of an arm (a monarch-sky controller, a torchrun, a lighthouse)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, cwd: Path):
        self.name, self.cmd, self.env, self.log_path, self.cwd = name, cmd, env, log, cwd
        self.proc: subprocess.Popen | None = None
        self.relaunch_at: float | None = None
        self.launches = 0

    def start(self) -> None:
        self.relaunch_at = None
        self.launches += 1
        with open(self.log_path, "a") as log:
            log.write(f"\n=== launch {self.launches}: {' '.join(self.cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def exit_code(self) -> int | None:
        """None while it runs or waits to be relaunched."""
        if self.relaunch_at is not None or self.proc is None:
            return None
        return self.proc.poll()

    def lose_host(self, delay_s: float) -> None:
        self.kill()
        self.relaunch_at = time.monotonic() + delay_s

    def tick(self) -> None:
        if self.relaunch_at is not None and time.monotonic() >= self.relaunch_at:
            self.start()

    def kill(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything it started (torchrun's workers run in their own sessions)."""
    try:
        root = psutil.Process(pid)
        victims = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for proc in victims:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


def signal_pid_file(path: Path, sig: signal.Signals) -> int | None:
    """Send `sig` to the process whose pid `path` holds; returns the pid (None: not running)."""
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, sig)
        return pid
    except (OSError, ValueError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
