"""Controller lifecycle: Ctrl-C stops everything; a new controller cleans up after a dead one,
and goes on from the run's newest checkpoint when node memory holds nothing newer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, TAG_ENV, cli_env, leftovers, new_tag, small_disk, start, train, train_command, wait_for_event

from monarch_sky.common import checkpoints, test_hooks
from monarch_sky.common.test_hooks import LEAK_ENV
from monarch_sky.hosts.base import CONTROLLER_ENV

# The checkpoint tests lose what node memory would keep (as when every node is lost): the last
# resort is what they test (node memory: tests/test_controller_loss.py).
NO_MEMORY = "snapshot.every_steps=0"


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
        helpers = w_and_b_helpers(tag)
        assert helpers, "expected the controller's W&B helpers (wandb-core)"
        assert all(env.get(CONTROLLER_ENV) == tag for env in helpers.values()), \
            f"the controller's helpers must carry its run id, so the next controller can reap them: {sorted(helpers)}"
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
    assert "lost its previous controller" in run.output and "else from step 0" in run.output
    [restart] = [e for e in run.events if e["event"] == "controller_restarted"]
    assert restart["reaped_processes"] > 0
    assert restart["last_step"] > 0
    assert run.summary["previous_controller"]["last_step"] == restart["last_step"]
    assert run.leftovers == []


def w_and_b_helpers(tag: str) -> dict[int, dict]:
    """{pid: environment} of the W&B processes a run with `tag` started."""
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            env = p.environ()
            if env.get(TAG_ENV) == tag and "wandb" in " ".join(p.info["cmdline"] or []):
                found[p.pid] = env
        except (psutil.Error, OSError):
            continue
    return found


def test_a_process_that_outlives_the_runs_stop_is_named_in_the_summary_then_killed(tmp_path):
    # The negative control of every test's `run.leftovers == []`: rank 0 of group 1 starts a
    # process in its own session, which the orderly stop (groups, then hosts) cannot reach.
    run = train(tmp_path, "replicas=2", "procs_per_replica=1", "steps=6", "faults=none", "ft.standby=false",
                env={LEAK_ENV: "1"})
    assert run.returncode == 0, run.output[-3000:]
    [left] = run.summary["left_running"]
    assert left.endswith(": sleep 600"), left
    assert [e["processes"] for e in run.events if e["event"] == "left_running"] == [[left]]
    assert "outlived its stop" in run.output
    assert run.leftovers == [f"left running at the stop: {left}"], "and the run's reap still killed it"


def test_a_finished_run_id_is_not_trained_again_and_says_how_it_ended(tmp_path):
    # A managed job restarted after its run finished gets the run's own exit code, not an error.
    run = train(tmp_path, "replicas=1", "steps=2", "training.warmup_steps=1", "faults=none", "ft.standby=false")
    assert run.returncode == 0, run.output[-3000:]
    summary = (run.path / "summary.json").read_text()
    again = subprocess.run(
        train_command(tmp_path, run.path.name), cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert "already finished (ok, exit 0)" in again.stderr and "nothing left to train" in again.stderr
    assert (run.path / "summary.json").read_text() == summary, "the finished run's record is untouched"


def test_an_incomplete_run_trains_again_under_its_run_id(tmp_path):
    # Both groups are lost at step 3 with no restarts left: the run ends incomplete (exit 1).
    first = train(tmp_path, "replicas=2", "steps=8", "faults=kill@3:0,kill@3:1", "ft.max_restarts=0", "ft.standby=false")
    assert first.returncode == 1 and first.summary["outcome"]["status"] == "incomplete", first.output[-3000:]
    run = train(tmp_path, "replicas=2", "steps=8", "faults=none", "ft.standby=false", tag=first.path.name)
    assert run.returncode == 0, run.output[-3000:]
    assert run.summary["committed_steps"] == 8
    assert [p.name for p in run.path.glob("summary-*.json")] == ["summary-incomplete-0.json"]
    [restart] = [e for e in run.events if e["event"] == "controller_restarted"]
    assert restart["ended"] == "incomplete", restart


def complete_checkpoints(folder) -> list[int]:
    return [s for s, p in checkpoints.step_dirs(folder) if (p / ".metadata").is_file() and (p / checkpoints.NOTE).is_file()]


def kill_once_checkpointed(tmp_path, tag: str, *overrides: str, folder=None, complete: int = 1) -> dict:
    """Start a run with checkpoints on, SIGKILL its controller once `complete` checkpoints are
    complete and a few more steps have committed; returns the newest checkpoint's step.
    Its steps are slowed (0.25 s each) so that it is still training then, however fast the
    machine: tiny steps take 0.1 s, and 40 of them once ended before the kill."""
    first = start(tmp_path, tag, *overrides, env={test_hooks.STEP_PAUSE_ENV: "0.25"})
    folder = folder or tmp_path / tag / "checkpoints"
    try:
        wait_for_event(tmp_path / tag / "events.jsonl", "checkpoint_noted", timeout_s=300)
        deadline = time.monotonic() + 120
        while len(complete_checkpoints(folder)) < complete and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # a few steps past it: those are lost
        assert first.poll() is None, "the run ended before its controller was killed: the test proves nothing"
        first.kill()  # the controller dies; its hosts and trainers do not
        first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    return {"newest_at_kill": checkpoints.newest(folder).step}


def test_a_run_killed_with_its_controller_resumes_from_its_newest_checkpoint(tmp_path):
    tag = new_tag()
    args = ("replicas=2", "procs_per_replica=1", "steps=40", "faults=none", "ft.standby=false",
            "checkpoint.every_min=0.03", "checkpoint.keep=2", NO_MEMORY)
    killed = kill_once_checkpointed(tmp_path, tag, *args)
    run = train(tmp_path, *args, tag=tag)
    assert run.returncode == 0, run.output[-3000:]
    s = run.summary
    previous = s["previous_controller"]
    step, lost = previous["resumed_from_step"], previous["steps_lost"]
    assert step >= killed["newest_at_kill"] > 0, (previous, killed)
    assert lost == previous["last_step"] - step >= 0
    assert f"Resumed from the checkpoint at step {step}; lost {lost} steps" in run.output
    [resumed] = [e for e in run.events if e["event"] == "resumed_from_checkpoint"]
    assert resumed["step"] == step
    # The second controller trained only the steps after the checkpoint, on its state.
    restarted = next(e["wall"] for e in run.events if e["event"] == "controller_restarted")
    lines = [json.loads(line) for line in (run.path / "steps.jsonl").read_text().splitlines()]
    again = sorted({x["step"] for x in lines if x["wall"] > restarted and x["committed"]})
    assert again == list(range(step + 1, 41)), again
    assert s["committed_steps"] == 40 and s["outcome"]["status"] == "ok"
    assert set(s["scheduler_steps"].values()) == {40}, "the LR schedule did not go on from the checkpoint"
    digests = s["final_param_digest"]
    assert sorted(digests) == ["0", "1"] and len(set(digests.values())) == 1, digests
    assert s["checkpoints_written"] > 0 and s["checkpoint"]["resumed_from_step"] == step
    assert run.leftovers == []


def truncate(checkpoint) -> None:
    """Damage a complete checkpoint the way a half-copied bucket does: its tensor files are
    empty, its `.metadata` and note intact (so it still counts as complete)."""
    for f in checkpoint.glob("*.distcp"):
        f.write_bytes(b"")


def test_a_checkpoint_that_cannot_be_loaded_is_set_aside_and_the_run_resumes_from_the_one_before(tmp_path):
    tag = new_tag()
    args = ("replicas=2", "procs_per_replica=1", "steps=60", "faults=none", "ft.standby=false",
            "checkpoint.every_min=0.03", "checkpoint.keep=3", NO_MEMORY)
    killed = kill_once_checkpointed(tmp_path, tag, *args, complete=2)
    folder = tmp_path / tag / "checkpoints"
    bad, older = killed["newest_at_kill"], complete_checkpoints(folder)[-2]
    truncate(folder / f"step-{bad}")
    run = train(tmp_path, *args, tag=tag)
    assert run.returncode == 0, run.output[-3000:]
    s = run.summary
    [unreadable] = [e for e in run.events if e["event"] == "checkpoint_unreadable"]
    assert (unreadable["step"], unreadable["going_back_to"]) == (bad, older), unreadable
    assert "cannot load the checkpoint step-" in unreadable["reason"], unreadable
    assert (folder / f"unreadable-{bad}").is_dir()  # (the resumed run may save a new step-{bad} of its own)
    previous = s["previous_controller"]
    assert previous["resumed_from_step"] == older and previous["steps_lost"] == previous["last_step"] - older, previous
    assert f"the checkpoint at step {bad} cannot be loaded" in run.output
    assert s["committed_steps"] == 60 and s["outcome"]["status"] == "ok", s["outcome"]
    assert set(s["scheduler_steps"].values()) == {60}
    assert len(set(s["final_param_digest"].values())) == 1, s["final_param_digest"]
    assert s["restarts"] == {"0": 0, "1": 0}, "an unreadable checkpoint cost a group a restart"
    assert run.leftovers == []


def test_a_checkpoint_one_group_fails_to_load_and_another_loads_is_kept_and_the_run_resumes_from_it(tmp_path):
    # Replica 1's first load fails (a flaky mount), replica 0 loads the same checkpoint: it is
    # readable, so it stays, the run goes on from it and replica 1 retries (one restart).
    tag = new_tag()
    args = ("replicas=2", "procs_per_replica=1", "steps=40", "faults=none", "ft.standby=false",
            "checkpoint.every_min=0.03", "checkpoint.keep=3", NO_MEMORY)
    killed = kill_once_checkpointed(tmp_path, tag, *args, complete=2)
    marker = tmp_path / "load-failed"
    run = train(tmp_path, *args, tag=tag, env={test_hooks.FAIL_A_LOAD_ENV: f"1:{marker}"})
    assert run.returncode == 0, run.output[-3000:]
    assert marker.exists(), "the load never failed: the test proves nothing"
    s, resumed = run.summary, run.summary["previous_controller"]["resumed_from_step"]
    assert resumed >= killed["newest_at_kill"] > 0, s["previous_controller"]  # (a write can complete after the kill)
    assert not [e for e in run.events if e["event"] == "checkpoint_unreadable"], "a checkpoint replica 0 loaded was set aside"
    [failed] = [e for e in run.events if e["event"] == "checkpoint_load_failed_here"]
    assert (failed["replica"], failed["step"], failed["loaded_by"]) == (1, resumed, [0]), failed
    assert not (tmp_path / tag / "checkpoints" / f"unreadable-{resumed}").exists()
    assert s["restarts"] == {"0": 0, "1": 1}
    assert s["committed_steps"] == 40 and s["outcome"]["status"] == "ok", s["outcome"]
    assert len(set(s["final_param_digest"].values())) == 1, s["final_param_digest"]
    assert run.leftovers == []


def test_a_checkpoint_write_that_fails_is_reported_at_once_and_the_next_save_is_tried(tmp_path):
    # The checkpoint folder is a 2 MB disk, each checkpoint ~11 MB: every write fails in the
    # background. Each failure is reported for its own step before the next save, training goes on.
    # Steps slowed (0.25 s each): 40 tiny ones take 3 s here, too few for two saves 1.8 s apart.
    with small_disk(tmp_path / "disk") as disk:
        run = train(tmp_path, "replicas=2", "procs_per_replica=1", "steps=40", "faults=none",
                    "checkpoint.every_min=0.03", f"checkpoint.folder={disk}", env={test_hooks.STEP_PAUSE_ENV: "0.25"})
    assert run.returncode == 0, run.output[-3000:]
    staged = [e["step"] for e in run.events if e["event"] == "checkpoint_staged"]
    failed = [e for e in run.events if e["event"] == "checkpoint_failed"]
    assert len(staged) >= 2 and {e["stage"] for e in failed} == {"write"}, (staged, failed)
    assert [e["step"] for e in failed] == staged[:len(failed)] and len(failed) >= len(staged) - 1, (staged, failed)
    assert "write of step" in run.output and run.summary["checkpoint"]["saved_steps"] == staged[len(failed):]
    assert run.summary["committed_steps"] == 40 and run.summary["outcome"]["status"] == "ok"


def test_a_controller_on_a_new_machine_resumes_from_the_shared_checkpoint_folder(tmp_path):
    # The run record stays on the dead pod's disk; the checkpoints are on a bucket. Another
    # run sharing that bucket keeps its own folder, untouched.
    tag, bucket = new_tag(), tmp_path / "bucket"
    other = bucket / "another-run" / "step-999"
    other.mkdir(parents=True)
    args = ("replicas=2", "procs_per_replica=1", "steps=40", "faults=none", "ft.standby=false",
            "checkpoint.every_min=0.03", "checkpoint.keep=2", f"checkpoint.folder={bucket}", NO_MEMORY)
    killed = kill_once_checkpointed(tmp_path / "old-pod", tag, *args, folder=bucket / tag)
    run = train(tmp_path / "new-pod", *args, tag=tag)
    assert run.returncode == 0, run.output[-3000:]
    previous = run.summary["previous_controller"]
    assert previous["resumed_from_step"] >= killed["newest_at_kill"] > 0, previous
    assert "its record is not on this machine" in run.output
    assert run.summary["committed_steps"] == 40 and run.summary["outcome"]["status"] == "ok"
    assert other.is_dir(), "another run's checkpoint was touched"
    assert run.leftovers == []


def can_hide_disks() -> bool:
    """Whether this machine lets a process mount a tmpfs in a mount namespace of its own."""
    if os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not can_hide_disks(), reason="hosts with a disk of their own are mount namespaces: root with CAP_SYS_ADMIN")
def test_checkpoints_into_a_folder_the_groups_hosts_cannot_see_stay_off_and_the_run_says_why(tmp_path):
    """Cloud nodes have disks of their own: a checkpoint folder on the controller's disk alone
    (the recipes' default without RUN_DIR) would keep each save on the node that wrote it, where
    no restarted controller finds it. Here every host's worker gets an empty tmpfs over the run's
    record folder (tests/providers.py private-disk): the run trains, saves nothing, and says why."""
    tag = new_tag()
    out = subprocess.run(
        [sys.executable, "tests/providers.py", "private-disk", f"run_dir={tmp_path}", f"run_id={tag}", "replicas=2",
         "procs_per_replica=1", "steps=15", "faults=none", "ft.standby=false", "checkpoint.every_min=0.01"],
        cwd=REPO, env=cli_env(tag), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    s = json.loads((tmp_path / tag / "summary.json").read_text())
    reason = s["checkpoint"]["off_because"]
    assert reason and str(tmp_path / tag / "checkpoints") in reason and "RUN_DIR" in reason, reason
    assert s["checkpoint"]["saved_steps"] == [] and s["checkpoints_written"] == 0
    assert s["committed_steps"] == 15 and s["outcome"]["status"] == "ok"
    events = [json.loads(line)["event"] for line in (tmp_path / tag / "events.jsonl").read_text().splitlines()]
    assert "checkpoints_off" in events and "checkpoints_on" not in events and "checkpoint_staged" not in events
    assert "WARNING: checkpoints off" in out.stdout
    assert leftovers(tag) == []


@pytest.mark.chaos
def test_a_resumed_run_ends_with_the_weights_of_a_run_never_interrupted(tmp_path):
    # Weights, optimizer moments, LR schedule, step count and every group's data position
    # all come back exactly: killed and resumed, the run ends bit for bit where an
    # uninterrupted one does (whenever every step of both committed with both groups).
    args = ("replicas=2", "procs_per_replica=2", "steps=40", "faults=none", "ft.standby=false")
    plain = train(tmp_path / "plain", *args)
    assert plain.returncode == 0 and plain.summary["checkpoints_written"] == 0, plain.output[-3000:]
    tag = new_tag()
    with_checkpoints = (*args, "checkpoint.every_min=0.03", NO_MEMORY)
    kill_once_checkpointed(tmp_path, tag, *with_checkpoints)
    run = train(tmp_path, *with_checkpoints, tag=tag)
    assert run.returncode == 0, run.output[-3000:]
    assert run.summary["previous_controller"]["resumed_from_step"] > 0
    partial = [
        (r.path.name, x["step"]) for r in (plain, run) for line in (r.path / "steps.jsonl").read_text().splitlines()
        if (x := json.loads(line))["committed"] and x["participants"] != 2
    ]
    if partial:
        pytest.skip(f"a step committed without both groups (a slow machine), so the runs differ anyway: {partial}")
    assert run.summary["final_param_digest"] == plain.summary["final_param_digest"]


@pytest.mark.chaos
def test_a_diloco_run_resumes_from_a_checkpoint_taken_at_a_sync(tmp_path):
    # DiLoCo checkpoints only at syncs; its TorchFT step counts syncs, the run's step is
    # syncs x sync_steps. (Its outer-optimizer momentum is not saved: no weight comparison.)
    tag = new_tag()
    args = ("replicas=2", "procs_per_replica=1", "steps=40", "faults=none", "ft.standby=false",
            "ft.mode=diloco", "ft.sync_steps=5", "checkpoint.every_min=0.03", NO_MEMORY)
    kill_once_checkpointed(tmp_path, tag, *args)
    run = train(tmp_path, *args, tag=tag)
    assert run.returncode == 0, run.output[-3000:]
    step = run.summary["previous_controller"]["resumed_from_step"]
    assert step > 0 and step % 5 == 0, step
    assert run.summary["committed_steps"] == 40
    assert len(set(run.summary["final_param_digest"].values())) == 1
    assert run.leftovers == []


@pytest.mark.parametrize("pod", ["same", "new"], ids=["same-machine", "new-pod-shared-checkpoints"])
def test_a_controller_fault_kills_the_controller_once_and_the_run_resumes_from_its_checkpoint(tmp_path, pod):
    # `controller@25`: the controller SIGKILLs itself mid-step; run again, it resumes from the
    # newest checkpoint, and neither it nor the kill before it fires a second time: known from
    # the run record, or on a new pod without it, from the list kept beside the checkpoints.
    args = ("replicas=2", "procs_per_replica=1", "steps=40", "faults=kill@8:1,controller@25", "ft.standby=false",
            "checkpoint.every_min=0.03", "checkpoint.keep=2", f"checkpoint.folder={tmp_path / 'bucket'}", NO_MEMORY,
            "controller.standby=false")
    first = train(tmp_path / "old-pod", *args)
    assert first.returncode == -signal.SIGKILL, first.output[-3000:]
    assert "SIGKILL of this controller at step 25" in first.output and f"run_id={first.path.name}" in first.output
    assert not (first.path / "summary.json").exists()
    run = train(tmp_path / ("old-pod" if pod == "same" else "new-pod"), *args, tag=first.path.name)
    assert run.returncode == 0, run.output[-3000:]
    fired = [(e["kind"], e["scheduled"]) for e in run.events if e["event"] == "fault_injected"]
    if pod == "same":  # the record holds both attempts' events
        restarted = next(e["wall"] for e in run.events if e["event"] == "controller_restarted")
        assert all(e["wall"] < restarted for e in run.events if e["event"] == "fault_injected")
        assert fired == [("kill", "kill@8:1"), ("controller", "controller@25")], fired
    else:
        assert "its record is not on this machine" in run.output
        assert fired == [], f"fired again after the restart: {fired}"
    previous = run.summary["previous_controller"]
    assert previous["faults_fired"] == ["kill@8:1", "controller@25"], previous
    assert 0 < previous["resumed_from_step"] <= 25, previous
    assert previous["last_step"] >= 25 if pod == "same" else previous["last_step"] == previous["resumed_from_step"]
    assert run.summary["committed_steps"] == 40 and run.summary["outcome"]["status"] == "ok"
    assert run.summary["faults_not_fired"] == []
    assert run.leftovers == []
