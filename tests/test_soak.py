"""The soak (`make soak`, about 20 minutes): one long run under every kind of fault at once.

Groups of two hosts; chaos of every kind, a share of it aimed at recoveries in progress; two
groups losing a host at the same step; the controller SIGKILLed midway (with its standby: a
node lost) and started again by hand under the same run id, which goes on from node memory.
Nothing may be lost beyond the snapshot interval (nor, when every group holding the state fails
at once, beyond the newest snapshot or checkpoint), the groups must end identical, and no
process or host may be left.
"""

from __future__ import annotations

import pytest

from conftest import new_tag, read_events, start, train, wait_for_event

MIN_FAULTS = 40
SNAPSHOT_EVERY = 10  # snapshot.every_steps, the default
ARGS = (
    "replicas=3", "hosts_per_replica=2", "procs_per_replica=1", "steps=360",
    "faults=host@30:0,host@30:1",  # two groups lose a host in the same step
    "chaos.every_s=4", "chaos.seed=4", "chaos.during_recovery=0.3",
    "checkpoint.every_min=0.5", "checkpoint.keep=2",
    "hosts.max_replacements=80", "ft.max_restarts=80",
)


@pytest.mark.soak
def test_a_soak_of_forty_faults_and_a_controller_kill_loses_nothing_beyond_the_snapshot_interval(tmp_path):
    tag = new_tag()
    record = tmp_path / tag
    first = start(tmp_path, tag, *ARGS)
    try:
        wait_for_event(record / "events.jsonl", "fault_injected", timeout_s=1500, count=MIN_FAULTS * 3 // 5)
        wait_for_event(record / "events.jsonl", "checkpoint_noted", timeout_s=300)
        first.kill()  # the controller dies with its standby (its node is lost); its hosts and trainers do not
        first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    before_kill = [e for e in read_events(record / "events.jsonl") if e["event"] == "fault_injected"]

    run = train(tmp_path, *ARGS, tag=tag, timeout_s=2400)
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    lost = s["controller_lost"]
    assert lost["restored_from"] == "memory" and lost["steps_lost"] <= SNAPSHOT_EVERY, lost
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == [], s
    assert no_loss_beyond_the_newest_saved_state(run.events)
    # "memory", "checkpoint": every group holding the state was down at once (a progress_lost says so)
    assert all(f["recovered_from"] in ("peer", "in place", "memory", "checkpoint") for f in s["faults"]), s["faults"]
    reloaded = [f for f in s["faults"] if f["recovered_from"] in ("memory", "checkpoint")]
    assert not reloaded or s["progress_lost"], (reloaded, s["progress_lost"])
    assert all(p["from_memory"] or p["from_checkpoint"] for p in s["progress_lost"]), s["progress_lost"]
    faults = before_kill + s["faults"]
    during = [f for f in s["faults"] if f["during"] == "rejoin"]
    hosts = [f for f in s["faults"] if f["kind"] == "host"]
    assert len(faults) >= MIN_FAULTS and during and hosts, f"too little chaos: {len(faults)} faults, {s['faults']}"
    assert s["committed_steps"] == 360 and s["outcome"]["status"] == "ok"
    digests = s["final_param_digest"]
    assert len(digests) == 3 and len(set(digests.values())) == 1, digests
    assert run.leftovers == [], run.leftovers
    print(f"\nsoak: {len(faults)} faults ({len(before_kill)} before the controller kill), {len(during)} during a heal, "
          f"{len(hosts)} host losses after it; went on from step {lost['step']} in node memory, "
          f"{lost['steps_lost']} steps lost, training again {lost['training_again_s']} s after the loss; "
          f"not fired: {s['faults_not_fired']}")


def no_loss_beyond_the_newest_saved_state(events: list[dict]) -> bool:
    """Every group holding the state may fail at once (the schedule's two host losses while
    the third group recovers): training may then go back no further than the newest complete
    checkpoint before it, nor more than a snapshot interval when it goes back to node memory."""
    newest = 0
    for e in events:
        if e["event"] == "checkpoint_noted":
            newest = max(newest, e["step"])
        if e["event"] == "progress_lost":
            assert e["restarted_at_step"] >= newest, (
                f"training went back from step {e['at_step']} to {e['restarted_at_step']}, "
                f"behind the checkpoint at step {newest}"
            )
            if e["from_memory"]:
                assert e["at_step"] - e["restarted_at_step"] <= 2 * SNAPSHOT_EVERY, e  # a snapshot per interval
    return True
