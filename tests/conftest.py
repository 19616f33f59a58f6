"""Helpers for tests that run monarch-sky for real: the CLI, Monarch, TorchFT, TorchTitan."""

from __future__ import annotations

import contextlib
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

# Every run the tests start keeps its node memory (monarch_sky/common/node_memory.py) under one
# folder of this session, given back at its end: a test that kills a controller and never
# starts it again would otherwise leave its snapshots in /dev/shm.
NODE_MEMORY = Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp") / f"monarch-sky-tests-{os.getpid()}"
os.environ["MONARCH_SKY_NODE_MEMORY"] = str(NODE_MEMORY)


@pytest.fixture(autouse=True, scope="session")
def _give_node_memory_back():
    yield
    import shutil

    shutil.rmtree(NODE_MEMORY, ignore_errors=True)


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
        return read_events(self.path / "events.jsonl")


TAG_ENV = "MONARCH_SKY_TEST_TAG"


def cli_env(tag: str = "") -> dict[str, str]:
    """The CLI's environment; every process it starts inherits `tag`, so tests can find them."""
    # NETRC: a W&B key `wandb login` left on this machine must not take the tests online
    env = {**os.environ, "WANDB_MODE": "offline", "NETRC": "/dev/null", "PYTHONUNBUFFERED": "1", TAG_ENV: tag}
    env.pop("WANDB_API_KEY", None)
    return env


def new_tag() -> str:
    return f"t{os.getpid()}-{time.monotonic_ns()}"


def train_command(run_dir: Path, run_id: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "monarch_sky", "train", f"run_dir={run_dir}", f"run_id={run_id}", *overrides]


def train(
    tmp_path: Path, *overrides: str, tag: str | None = None, timeout_s: float = 600, env: dict | None = None
) -> Run:
    """Run `monarch-sky train` to completion and report what it left running.

    `env`: extra environment, e.g. a test hook (MONARCH_SKY_TEST_*).
    """
    tag = tag or new_tag()
    proc = subprocess.run(
        train_command(tmp_path, tag, *overrides),
        cwd=REPO,
        env={**cli_env(tag), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    run = Run(proc.returncode, proc.stdout + proc.stderr, tmp_path / tag, leftovers(tag))
    if (run.path / "summary.json").exists():  # what outlived the run's orderly stop, before its reap
        run.leftovers += [f"left running at the stop: {p}" for p in run.summary.get("left_running", [])]
    return run


def start(tmp_path: Path, tag: str, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """`monarch-sky train` in the background, its output in one pipe (`env`: as `train`'s)."""
    return subprocess.Popen(
        train_command(tmp_path, tag, *overrides),
        cwd=REPO, env={**cli_env(tag), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def read_events(path: Path) -> list[dict]:
    """The events a run record holds; of a file still being written, only its whole lines."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # after the last newline: nothing, or a line half written
    return [json.loads(line) for line in lines if line.strip()]


def wait_for_event(path: Path, name: str, timeout_s: float, count: int = 1) -> None:
    """Until the run record's events.jsonl at `path` holds `count` events called `name`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(e["event"] == name for e in read_events(path)) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"fewer than {count} {name} events within {timeout_s}s")


def leftovers(tag: str, grace_s: float = 10.0) -> list[str]:
    """Processes carrying `tag` in their environment still alive (after a short grace)."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if p.info["status"] == psutil.STATUS_ZOMBIE or p.environ().get(TAG_ENV) != tag:
                    continue
            except (psutil.Error, OSError):
                continue
            alive.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path


def one_rank_trainer_env():
    """A lighthouse and the torch.distributed environment for one trainer in this process
    (a replica group of one rank); returns the lighthouse, which must stay referenced."""
    from torchft.coordination import LighthouseServer

    from monarch_sky.hosts.base import free_port

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = lighthouse.address().rsplit(":", 1)[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
        LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
        MONARCH_SKY_HEAL_SECRET=os.urandom(32).hex(),
    )
    return lighthouse


def in_fresh_interpreter(target, tmp: Path, timeout_s: float = 300) -> dict:
    """Run `target(str(tmp), queue)` in a spawned interpreter (the CPU shims must apply before
    torchtitan is first imported); returns what it put on the queue."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(str(tmp), queue))
    proc.start()
    try:
        return queue.get(timeout=timeout_s)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


@contextlib.contextmanager
def small_disk(path: Path, size: str = "2m"):
    """A tmpfs of `size` mounted at `path` (root only: the test is skipped otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
