"""The fault kinds beyond a dead process: a comms abort, a hung trainer, a frozen one, and
faults that land on a recovery in progress.

A comms abort leaves the process alive: TorchFT reconfigures its process group and the
group goes on without a respawn. A hang (GIL held in a native sleep, sockets open, TorchFT's
native heartbeats still beating) and a frozen process (SIGSTOP) are noticed from step
times plus a liveness ping, long before `timeouts.step_s`, and the group is respawned and
heals from a peer. Every group failing at once goes back to the newest checkpoint, or, with
none, starts over and says so.
"""

from __future__ import annotations

import json
import threading

import pytest

from conftest import new_tag, read_events, train
from monarch_sky.common import checkpoints


def test_comms_hang_and_stop_all_heal_with_equal_digests(run_dir):
    run = train(run_dir, "replicas=2", "steps=50", "faults=comms@10:1,hang@20:0,stop@32:1")
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["outcome"]["status"] == "ok"
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == []
    faults = {f["kind"]: f for f in s["faults"]}
    assert faults["comms"]["recovered_from"] == "in place", faults["comms"]
    assert faults["comms"]["detected_s"] is not None, "the abort must have failed a step"
    for kind in ("hang", "stop"):
        assert faults[kind]["recovered_from"] == "peer", faults[kind]
        assert faults[kind]["detected_s"] < s_step_timeout(run) / 10, f"{kind} noticed only near timeouts.step_s"
    assert s["restarts"] == {"0": 1, "1": 1}, "the comms fault needs no respawn"
    assert len(set(s["final_param_digest"].values())) == 1
    assert run.leftovers == [], run.leftovers


def s_step_timeout(run) -> float:
    [started] = [e for e in run.events if e["event"] == "run_started"]
    return started["config"]["timeouts"]["step_s"]


def test_every_group_failing_at_once_is_reported_as_lost_progress_not_a_recovery(run_dir):
    # Both groups die in the same step with node memory off and no checkpoint: nobody holds the
    # state, so the new generations can only "heal" from each other at step 0. The run must
    # say it started over.
    run = train(run_dir, "replicas=2", "steps=40", "faults=kill@12:0,kill@12:1", "snapshot.every_steps=0")
    assert run.returncode == 3, run.output[-4000:]
    s = run.summary
    [lost] = s["progress_lost"]
    assert lost["at_step"] >= 12 and lost["restarted_at_step"] < lost["at_step"]
    assert "scratch" in {f["recovered_from"] for f in s["faults"]}
    assert "peer" not in {f["recovered_from"] for f in s["faults"]}, "a fresh peer is no recovery"
    assert s["outcome"]["status"] == "degraded" and "training state lost" in s["outcome"]["reasons"][0]
    assert run.leftovers == [], run.leftovers


@pytest.mark.parametrize("faults", [
    "kill@30:0,kill@30:1",  # both at once: each new generation loads the checkpoint
    # the last holder dies while the other comes back to heal from it (~90 s: make e2e)
    pytest.param("kill@30:0,kill@31:1", marks=pytest.mark.e2e),
])
def test_every_group_failing_at_once_goes_back_to_the_newest_checkpoint_not_to_scratch(run_dir, faults):
    # With checkpoints on, a new generation with no one to heal from loads the newest complete
    # checkpoint; one already built to heal heals from it (or, alone, is rebuilt to load it).
    # The steps after it are trained again; nothing is lost beyond it, and the run ends ok.
    run = train(run_dir, "replicas=2", "steps=60", f"faults={faults}",
                "checkpoint.every_min=0.03", "checkpoint.keep=50", "snapshot.every_steps=0")
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    if not s["progress_lost"]:
        # Raced, nothing lost: the group coming back had healed (in a step the dying holder never
        # let commit) before the holder died, so it held the state; or the checkpoint of the
        # step the groups died at was complete (it is written beside the step), so the new
        # generations loaded the very step they were at (seen on a loaded machine).
        sources = [f["recovered_from"] for f in s["faults"]]
        if set(sources) == {"checkpoint"}:
            assert any((run.path / "checkpoints" / f"step-{n}" / ".metadata").is_file() for n in (30, 31)), sources
        else:
            assert sources == ["peer", "peer"] and "30:1" not in faults, s["faults"]
        assert s["outcome"]["status"] == "ok" and s["committed_steps"] == 60
        assert len(set(s["final_param_digest"].values())) == 1
        return
    [lost] = s["progress_lost"]
    at = next(i for i, e in enumerate(run.events) if e["event"] == "progress_lost")
    noted = [e["step"] for e in run.events[:at] if e["event"] == "checkpoint_noted"]
    complete = [n for n in noted if (run.path / "checkpoints" / f"step-{n}" / ".metadata").is_file()]
    step = lost["restarted_at_step"]
    assert complete and step == max(complete), (lost, noted, complete)
    assert lost["from_checkpoint"].endswith(f"step-{step}") and lost["at_step"] >= 30
    sources = [f["recovered_from"] for f in s["faults"]]
    assert "checkpoint" in sources and set(sources) <= {"checkpoint", "peer"}, s["faults"]
    assert all(f["heal_bytes"] == 0 for f in s["faults"] if f["recovered_from"] == "checkpoint"), s["faults"]
    steps = [json.loads(line) for line in (run.path / "steps.jsonl").read_text().splitlines()]
    again = sorted({x["step"] for x in steps if x["wall"] > run.events[at]["wall"] and x["committed"] and x["step"] > step})
    assert again == list(range(step + 1, 61)), again
    assert f"went back to the checkpoint at step {step}" in run.output
    assert s["outcome"]["status"] == "ok" and s["committed_steps"] == 60
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == []
    assert len(set(s["final_param_digest"].values())) == 1
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e  # ~2 min; test_lifecycle sets an unreadable checkpoint aside at a restart
def test_a_checkpoint_that_cannot_be_loaded_sends_the_run_back_to_the_one_before(run_dir):
    # Both groups die at step 30, and every checkpoint from step 20 on was damaged once
    # complete (its tensor files emptied, `.metadata` and note intact): each is set aside
    # in turn, and the run goes back to the newest one before step 20, not to scratch.
    tag = new_tag()
    record, damaged = run_dir / tag, []
    stop = threading.Event()

    def damage() -> None:
        while not stop.wait(0.02):
            if any(e["event"] == "progress_lost" for e in read_events(record / "events.jsonl")):
                return  # the run went back: what it saves from now on stays whole
            for step, path in checkpoints.step_dirs(record / "checkpoints"):
                if step >= 20 and step not in damaged and (path / ".metadata").is_file():
                    for f in path.glob("*.distcp"):
                        f.write_bytes(b"")
                    damaged.append(step)

    damager = threading.Thread(target=damage, daemon=True)
    damager.start()
    try:
        run = train(run_dir, "replicas=2", "steps=60", "faults=kill@30:0,kill@30:1",
                    "checkpoint.every_min=0.03", "checkpoint.keep=50", "snapshot.every_steps=0", tag=tag)
    finally:
        stop.set()
        damager.join(timeout=10)
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    set_aside = [e["step"] for e in run.events if e["event"] == "checkpoint_unreadable"]
    assert set_aside and set(set_aside) <= set(damaged), (set_aside, damaged)
    [lost] = s["progress_lost"]
    at = next(i for i, e in enumerate(run.events) if e["event"] == "progress_lost")
    noted = [e["step"] for e in run.events[:at] if e["event"] == "checkpoint_noted"]
    assert lost["restarted_at_step"] == max(n for n in noted if n < 20), (lost, noted, damaged)
    assert all((record / "checkpoints" / f"unreadable-{step}").is_dir() for step in set_aside)
    assert "checkpoint" in {f["recovered_from"] for f in s["faults"]}, s["faults"]
    assert s["outcome"]["status"] == "ok" and s["committed_steps"] == 60, s["outcome"]
    assert s["restarts"] == {"0": 1, "1": 1}, "an unreadable checkpoint cost a group a restart"
    assert len(set(s["final_param_digest"].values())) == 1
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e  # ~2 min; make chaos aims faults at recoveries too
def test_faults_that_hit_each_new_generation_while_it_heals_still_end_in_a_peer_rejoin(run_dir):
    # A kill, then a kill and a host loss aimed at the next two generations' first step back
    # (their heal): neither of those generations may count as rejoined; the third must
    # rejoin from a peer, with nothing lost and the digests equal.
    # A host's replacement takes ~20 s: enough steps left for the last generation to rejoin.
    run = train(run_dir, "replicas=2", "steps=150", "faults=kill@10:1,kill@rejoin:1,host@rejoin:1")
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == [] and s["faults_not_fired"] == []
    assert [(f["kind"], f["during"]) for f in s["faults"]] == [("kill", None), ("kill", "rejoin"), ("host", "rejoin")]
    assert all(f["recovered_from"] == "peer" for f in s["faults"]), s["faults"]
    assert s["restarts"]["1"] == 3
    started = {e["generation"]: e for e in run.events if e["event"] == "replica_started" and e["replica"] == 1}
    hit = [e for e in run.events if e["event"] == "fault_injected" and e.get("during") == "rejoin"]
    rejoined = [e["generation"] for e in run.events if e["event"] == "replica_rejoined" and e["replica"] == 1]
    assert len(hit) == 2 and rejoined == [max(started)], f"only the last generation rejoins: {rejoined}"
    assert len(set(s["final_param_digest"].values())) == 1
    assert run.leftovers == [], run.leftovers
