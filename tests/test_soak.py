"""The soak (`make soak`, about 20 minutes): one long run under every kind of fault at once.

Groups of two hosts; chaos of every kind, a share of it aimed at recoveries in progress; two
groups losing a host at the same step; the controller SIGKILLed midway with checkpoints on
and started again under the same run id. Nothing may be lost beyond the steps after the last
checkpoint, the groups must end identical, and no process or host may be left.
"""

from __future__ import annotations

import pytest

from conftest import new_tag, read_events, start, train, wait_for_event
from monarch_sky.common import checkpoints

MIN_FAULTS = 40
ARGS = (
    "replicas=3", "hosts_per_replica=2", "procs_per_replica=1", "steps=360",
    "faults=host@30:0,host@30:1",  # two groups lose a host in the same step
    "chaos.every_s=4", "chaos.seed=4", "chaos.during_recovery=0.3",
    "checkpoint.every_min=0.5", "checkpoint.keep=2",
    "hosts.max_replacements=80", "ft.max_restarts=80",
)


@pytest.mark.soak
def test_a_soak_of_forty_faults_and_a_controller_kill_loses_nothing_beyond_the_checkpoint(tmp_path):
    tag = new_tag()
    record = tmp_path / tag
    first = start(tmp_path, tag, *ARGS)
    try:
        wait_for_event(record / "events.jsonl", "fault_injected", timeout_s=1500, count=MIN_FAULTS * 3 // 5)
        wait_for_event(record / "events.jsonl", "checkpoint_noted", timeout_s=300)
        first.kill()  # the controller dies; its hosts and trainers do not
        first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    newest_at_kill = checkpoints.newest(record / "checkpoints").step
    before_kill = [e for e in read_events(record / "events.jsonl") if e["event"] == "fault_injected"]

    run = train(tmp_path, *ARGS, tag=tag, timeout_s=2400)
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    previous = s["previous_controller"]
    assert previous["resumed_from_step"] >= newest_at_kill > 0, previous
    assert previous["steps_lost"] == previous["last_step"] - previous["resumed_from_step"], previous
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == [], s
    assert no_loss_beyond_the_checkpoint(run.events)
    # "checkpoint": every group holding the state was down at once (then a progress_lost says so)
    assert all(f["recovered_from"] in ("peer", "in place", "checkpoint") for f in s["faults"]), s["faults"]
    from_checkpoint = [f for f in s["faults"] if f["recovered_from"] == "checkpoint"]
    assert not from_checkpoint or s["progress_lost"], (from_checkpoint, s["progress_lost"])
    assert all(p["from_checkpoint"] for p in s["progress_lost"]), s["progress_lost"]
    faults = before_kill + s["faults"]
    during = [f for f in s["faults"] if f["during"] == "rejoin"]
    hosts = [f for f in s["faults"] if f["kind"] == "host"]
    assert len(faults) >= MIN_FAULTS and during and hosts, f"too little chaos: {len(faults)} faults, {s['faults']}"
    assert s["committed_steps"] == 360 and s["outcome"]["status"] == "ok"
    digests = s["final_param_digest"]
    assert len(digests) == 3 and len(set(digests.values())) == 1, digests
    assert run.leftovers == [], run.leftovers
    print(f"\nsoak: {len(faults)} faults ({len(before_kill)} before the controller kill), {len(during)} during a heal, "
          f"{len(hosts)} host losses after it; resumed at step {previous['resumed_from_step']}, "
          f"{previous['steps_lost']} steps lost; not fired: {s['faults_not_fired']}")


def no_loss_beyond_the_checkpoint(events: list[dict]) -> bool:
    """Every group holding the state may fail at once (the schedule's two host losses while
    the third group recovers): training may then go back no further than the newest
    complete checkpoint before it (the live controller loads it), in either attempt."""
    newest = 0
    for e in events:
        if e["event"] == "checkpoint_noted":
            newest = max(newest, e["step"])
        if e["event"] == "progress_lost":
            assert e["restarted_at_step"] >= newest, (
                f"training went back from step {e['at_step']} to {e['restarted_at_step']}, "
                f"behind the checkpoint at step {newest}"
            )
    return True
