"""No single loss ends the run: the controller's own, with no checkpoint, goes on from the state
every trainer keeps in its node's memory; so does every group lost at once."""

from __future__ import annotations

import json
import signal

import pytest

from conftest import new_tag, train

SNAPSHOT_EVERY = 10  # snapshot.every_steps, the default


def committed_by_all(run) -> bool:
    """Whether every committed step of the run had every group in its quorum (on a loaded
    2-core machine one can commit alone, and then two runs' weights differ anyway)."""
    return all(x["participants"] == 2 for line in (run.path / "steps.jsonl").read_text().splitlines()
               if (x := json.loads(line))["committed"])


def assert_went_on_from_memory(run, lost_at: int) -> dict:
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    lost = s["controller_lost"]
    assert lost["restored_from"] == "memory", lost
    assert lost_at - SNAPSHOT_EVERY <= lost["step"] <= lost_at and lost["steps_lost"] <= SNAPSHOT_EVERY, lost
    assert s["checkpoints_written"] == 0 and not (run.path / "checkpoints").exists()
    assert s["committed_steps"] == 40 and s["outcome"]["status"] == "ok"
    assert len(set(s["final_param_digest"].values())) == 1
    assert run.leftovers == [], run.leftovers
    return lost


def test_a_lost_controller_is_replaced_by_its_standby_and_the_run_ends_as_if_never_interrupted(tmp_path):
    # `controller@25` SIGKILLs the controller: its standby starts another under the run id,
    # which finds the newest step some group's hosts hold whole in node memory, loads it
    # there and trains on. Weights, optimizer, schedule and every group's data position come
    # back exactly: the run ends bit for bit where a run never interrupted does.
    args = ("replicas=2", "procs_per_replica=2", "steps=40", "ft.standby=false")
    run = train(tmp_path, *args, "faults=controller@25")
    lost = assert_went_on_from_memory(run, lost_at=25)
    assert "the standby starts another" in run.output and "going on from step" in run.output
    assert lost["loaded_by"] == [0, 1] and lost["detected_s"] is not None and lost["training_again_s"] > 0
    fired = [e["scheduled"] for e in run.events if e["event"] == "fault_injected"]
    assert fired == ["controller@25"], f"the next controller must not fire it again: {fired}"
    plain = train(tmp_path, *args, "faults=none")
    assert plain.returncode == 0, plain.output[-3000:]
    if not (committed_by_all(run) and committed_by_all(plain)):
        pytest.skip("a step committed without both groups (a slow machine), so the runs differ anyway")
    assert run.summary["final_param_digest"] == plain.summary["final_param_digest"]


def test_a_controller_started_again_by_hand_goes_on_from_node_memory(tmp_path):
    tag = new_tag()
    args = ("replicas=2", "procs_per_replica=1", "steps=40", "ft.standby=false", "controller.standby=false",
            "faults=kill@8:1,controller@25")
    first = train(tmp_path, *args, tag=tag)
    assert first.returncode == -signal.SIGKILL, first.output[-3000:]
    assert f"run it again with run_id={tag}" in first.output
    # The same run id under another shape: its trainers could not load that memory (TorchTitan's
    # dataloader refuses another dp degree), so the run is refused, naming the field, and the
    # memory stays for the run again under the saved shape.
    other = train(tmp_path, *args, "replicas=3", tag=tag)
    assert other.returncode == 2, other.output[-3000:]
    assert "was saved with replicas=2; this run asks replicas=3" in other.output, other.output[-3000:]
    assert other.summary["outcome"]["status"] == "refused" and other.summary["committed_steps"] == 0
    run = train(tmp_path, *args, tag=tag)
    assert_went_on_from_memory(run, lost_at=25)
    assert run.summary["faults_not_fired"] == []
    refired = [e for e in run.events if e["event"] == "fault_injected"
               and e["wall"] > next(x["wall"] for x in run.events if x["event"] == "controller_restarted")]
    assert refired == [], f"fired again after the restart: {refired}"


@pytest.mark.e2e
def test_every_group_lost_at_once_goes_back_to_node_memory_not_to_scratch(tmp_path):
    run = train(tmp_path, "replicas=2", "steps=40", "faults=kill@23:0,kill@23:1")
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    [lost] = s["progress_lost"]
    assert lost["from_memory"] and lost["restarted_at_step"] == 20 and lost["at_step"] >= 23, lost
    assert "memory" in {f["recovered_from"] for f in s["faults"]}, s["faults"]
    assert "went back to the state in node memory at step 20" in run.output
    assert s["outcome"]["status"] == "ok" and s["checkpoints_written"] == 0
    assert len(set(s["final_param_digest"].values())) == 1
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e
def test_a_diloco_run_goes_on_from_a_snapshot_taken_at_a_sync(tmp_path):
    run = train(tmp_path, "replicas=2", "procs_per_replica=1", "steps=40", "ft.mode=diloco", "ft.sync_steps=5",
                "faults=controller@27")
    lost = assert_went_on_from_memory(run, lost_at=27)
    assert lost["step"] % 5 == 0, lost


@pytest.mark.e2e
def test_a_group_whose_node_memory_was_lost_heals_from_the_group_that_loads_it(tmp_path):
    # Replica 1's host is lost (its memory with it) before the controller is: the next
    # controller finds the state only on replica 0's host; replica 1 heals from it live.
    run = train(tmp_path, "replicas=2", "procs_per_replica=1", "steps=40", "faults=host@10:1,controller@30")
    lost = assert_went_on_from_memory(run, lost_at=30)
    assert lost["loaded_by"] == [0], lost
    healed = [e for e in run.events if e["event"] == "replica_rejoined" and e["replica"] == 1]
    assert healed and healed[-1]["recovered_from"] == "peer", healed


def test_a_controller_whose_hosts_a_newer_controller_claimed_stops_driving_the_run(tmp_path, monkeypatch):
    # The fence: a standby on another node took the run over (this controller's node was cut
    # off, not dead), and claimed the hosts with a newer epoch. At its next note the old one
    # hears it, stops driving, leaves the hosts and their memory be, and writes no summary.
    from conftest import NODE_MEMORY, start, wait_for_event

    from monarch_sky.common import node_memory

    tag = new_tag()
    proc = start(tmp_path, tag, "replicas=2", "procs_per_replica=1", "steps=10000", "faults=none",
                 "ft.standby=false", "controller.standby=false")
    try:
        wait_for_event(tmp_path / tag / "events.jsonl", "training_started", timeout_s=300)
        for host in (NODE_MEMORY / "local-hosts").glob("local-*"):
            monkeypatch.setenv(node_memory.ROOT_ENV, str(host))
            node_memory.claim(tag, 99, "a standby elsewhere")
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 5, output[-3000:]
    assert "claimed its hosts" in output and "stopped driving run" in output
    events = [json.loads(line)["event"] for line in (tmp_path / tag / "events.jsonl").read_text().splitlines()]
    assert "controller_fenced" in events and "superseded" in events
    assert "node_memory_freed" not in events, "the memory is the newer controller's"
    assert not (tmp_path / tag / "summary.json").exists()
