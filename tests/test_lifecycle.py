"""Controller lifecycle: Ctrl-C stops everything; a new controller cleans up after a dead one."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from conftest import REPO, cli_env, leftovers, new_tag, train, train_command


def wait_for_event(path, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if any(e["event"] == name for e in events):
                return
        time.sleep(0.5)
    raise AssertionError(f"no {name} event within {timeout_s}s")


def start(tmp_path, tag: str, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        train_command(tmp_path, tag, *overrides),
        cwd=REPO, env=cli_env(tag), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_stops_every_process_and_writes_the_record(tmp_path, signum):
    # SIGTERM is what Slurm, Kubernetes, `sky cancel` and `timeout` send: a stop, like Ctrl-C.
    tag = new_tag()
    proc = start(tmp_path, tag, "replicas=2", "steps=10000", "faults=none", "ft.standby=false")
    try:
        wait_for_event(tmp_path / tag / "events.jsonl", "training_started", timeout_s=300)
        time.sleep(3)  # mid-training
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, output[-3000:]
    name = signal.Signals(signum).name
    assert f"stopped by {name}" in output
    assert leftovers(tag) == []
    summary = json.loads((tmp_path / tag / "summary.json").read_text())
    assert summary["outcome"] == {"exit_code": 128 + signum, "status": "stopped", "reasons": [f"stopped by {name}"]}
    assert 0 < summary["committed_steps"] < 10000


def test_new_controller_reaps_a_dead_controllers_processes(tmp_path):
    tag = new_tag()
    first = start(tmp_path, tag, "replicas=2", "steps=400", "faults=none", "ft.standby=false")
    try:
        wait_for_event(tmp_path / tag / "events.jsonl", "progress", timeout_s=300)
        first.kill()  # the controller dies; its hosts and trainers do not
        first.communicate(timeout=30)
        orphans = leftovers(tag, grace_s=0)
        assert orphans, "expected the dead controller's processes to outlive it"
        # The same run id again: the new controller must reap them and say what was lost.
        run = train(tmp_path, "replicas=2", "steps=10", "faults=none", "ft.standby=false", tag=tag)
    finally:
        if first.poll() is None:
            first.kill()
    assert run.returncode == 0, run.output[-3000:]
    assert "lost its previous controller" in run.output and "starts again from step 0" in run.output
    [restart] = [e for e in run.events if e["event"] == "controller_restarted"]
    assert restart["reaped_processes"] > 0
    assert restart["last_step"] > 0
    assert run.summary["previous_controller"]["last_step"] == restart["last_step"]
    assert run.leftovers == []


def test_a_finished_run_id_is_not_reused(tmp_path):
    run = train(tmp_path, "replicas=1", "steps=2", "training.warmup_steps=1", "faults=none", "ft.standby=false")
    assert run.returncode == 0, run.output[-3000:]
    again = subprocess.run(
        train_command(tmp_path, run.path.name), cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
    )
    assert again.returncode == 2
    assert "run_id" in again.stderr and "already finished" in again.stderr
