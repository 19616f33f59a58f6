"""End to end on CPU: real Monarch, TorchFT lighthouse and managers, TorchTitan trainers.

Each test runs `monarch-sky train` with one injected fault and checks what a user cares
about: training finished, the survivors never died, the failed replica group came back
with weights from a peer (no checkpoint), all groups ended with identical weights, the
loss went down, and nothing was left running.
"""

from __future__ import annotations

from conftest import Run, train

CHECKPOINT_MARKS = ("checkpoint", ".distcp", ".safetensors", ".pt")


def assert_recovered(run: Run, kind: str, replica: int, replicas: int) -> dict:
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["committed_steps"] == s["target_steps"]
    assert s["unplanned_failures"] == [], "a survivor died because a peer died"
    assert s["lost_replicas"] == []
    [fault] = s["faults"]
    assert (fault["kind"], fault["replica"]) == (kind, replica)
    assert fault["detected_s"] is not None
    assert fault["survivors_resumed_s"] is not None
    assert fault["rejoined_s"] is not None
    assert fault["recovered_from"] == "peer"
    digests = s["final_param_digest"]
    assert sorted(digests) == [str(i) for i in range(replicas)]
    assert len(set(digests.values())) == 1, f"replicas ended with different weights: {digests}"
    assert set(s["scheduler_steps"].values()) == {s["committed_steps"]}, "LR schedule counted uncommitted steps"
    assert len(set(s["final_lr"].values())) == 1
    assert s["checkpoints_written"] == 0
    written = [p for p in run.path.rglob("*") if any(m in p.name for m in CHECKPOINT_MARKS)]
    assert written == [], f"checkpoint files on the recovery path: {written}"
    assert s["loss"]["last"] < s["loss"]["first"]
    assert run.leftovers == [], f"processes left behind: {run.leftovers}"
    return fault


def test_kill_survivors_train_on_and_replica_heals_from_peer(run_dir):
    # Cold respawn (no standby): the survivors train alone for a while.
    run = train(run_dir, "replicas=2", "steps=160", "faults=kill@20:1", "ft.standby=false")
    fault = assert_recovered(run, "kill", replica=1, replicas=2)
    assert fault["steps_while_down"] > 0, "survivors committed no step while the replica was down"
    assert run.summary["uncommitted_steps"]["0"] > 0, "the kill should have failed a survivor's step"
    events = [e["event"] for e in run.events]
    assert events.index("fault_injected") < events.index("failure_detected") < events.index("replica_rejoined")


def test_segfault_recovers_from_warm_standby(run_dir):
    run = train(run_dir, "replicas=3", "steps=40", "faults=segfault@15:2")
    assert_recovered(run, "segfault", replica=2, replicas=3)
    restarted = [e for e in run.events if e["event"] == "replica_started" and e["generation"] > 0]
    assert [(e["replica"], e["from_standby"]) for e in restarted] == [(2, True)]
    assert "segfault -> replica 2" in run.output and "rejoined" in run.output


def test_diloco_heals_at_the_next_sync(run_dir):
    run = train(run_dir, "replicas=2", "steps=40", "ft.mode=diloco", "ft.sync_steps=5", "faults=kill@15:0")
    assert_recovered(run, "kill", replica=0, replicas=2)
    assert run.summary["ft_mode"] == "diloco"


def test_host_loss_replacement_host_rejoins_from_peer(run_dir):
    run = train(run_dir, "replicas=2", "steps=200", "faults=host@20:1", "hosts.provision_delay_s=2")
    fault = assert_recovered(run, "host", replica=1, replicas=2)
    assert fault["rank"] is None, "a host fault takes every rank"
    assert fault["steps_while_down"] > 0, "survivors committed no step while the host was gone"
    [replaced] = [e for e in run.events if e["event"] == "host_replaced"]
    [lost] = [e for e in run.events if e["event"] == "host_lost"]
    assert replaced["host"] != lost["host"], "the group moved to a new host"


def test_replacement_host_never_arrives_training_finishes_without_it(run_dir):
    run = train(
        run_dir, "replicas=2", "steps=60", "faults=host@15:1",
        "hosts.provision_delay_s=600", "hosts.provision_timeout_s=2",
    )
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["committed_steps"] == 60
    assert s["unplanned_failures"] == []
    [lost] = s["lost_replicas"]
    assert lost["replica"] == 1 and "no replacement" in lost["reason"]
    [fault] = s["faults"]
    assert fault["rejoined_s"] is None and fault["recovered_from"] is None
    assert list(s["final_param_digest"]) == ["0"], "only the survivor finished"
    assert "replica 1 was lost" in run.output
    assert run.leftovers == [], run.leftovers
