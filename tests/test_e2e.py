"""End to end on CPU: real Monarch, TorchFT lighthouse and managers, TorchTitan trainers.

Each test runs `monarch-sky train` with one injected fault and checks what a user cares
about: training finished, the survivors never died, the failed replica group came back
with weights from a peer (no checkpoint), all groups ended with identical weights, the
loss went down, and nothing was left running.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, Run, cli_env, leftovers, new_tag, train

from monarch_sky.common import test_hooks
from monarch_sky.recipes import RECIPES

CHECKPOINT_MARKS = ("checkpoint", ".distcp", ".safetensors", ".pt")


def assert_recovered(run: Run, kind: str, replica: int, replicas: int) -> dict:
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["outcome"] == {"exit_code": 0, "status": "ok", "reasons": []}
    assert s["committed_steps"] == s["target_steps"]
    assert s["unplanned_failures"] == [], "a survivor died because a peer died"
    assert s["lost_replicas"] == []
    [fault] = s["faults"]
    assert (fault["kind"], fault["replica"]) == (kind, replica)
    assert fault["detected_s"] is not None
    assert fault["survivors_resumed_s"] is not None
    assert fault["rejoined_s"] is not None
    assert fault["recovered_from"] == "peer"
    # The heal carried the whole training state: 4 bytes of parameter and 8 of AdamW moments per
    # parameter (plus the optimizers' step counters), split over the group's ranks.
    params = RECIPES[s["recipe"]].params
    assert 12 * params <= fault["heal_bytes"] < 12 * params + 4096, fault["heal_bytes"]
    assert fault["heal_step_s"] > 0
    [rejoined] = [e for e in run.events if e["event"] == "replica_rejoined"]
    # the rejoin names the path the bytes took: "rdma (ibverbs)" or "rdma (tcp fallback)" for rdma
    assert rejoined["heal_transport"].split()[0] == s["heal_transport"] in ("tcp", "rdma", "http")
    if s["heal_transport"] in ("tcp", "rdma"):  # ours time their transfers and name their sources
        assert 0 < fault["heal_s"] <= fault["heal_step_s"] and fault["heal_gb_per_s"] > 0
        assert rejoined["heal_sources"], "the transport names the ranks it healed from"
    between = s["between_steps"]  # the controller's turn between a group's steps, against the step
    assert between["median_s"] >= 0 and between["step_s"] > 0 and 0 <= between["share"] < 1
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


def test_a_qwen3_group_heals_a_kill_from_a_peer_as_a_llama3_one_does(run_dir):
    # Another TorchTitan family: QK norm, tied embeddings, its own parallelize function.
    run = train(run_dir, "recipe=qwen3_tiny", "replicas=2", "steps=60", "faults=kill@20:1")
    assert_recovered(run, "kill", replica=1, replicas=2)


def test_a_tensor_parallel_group_heals_a_kill_from_a_peer(run_dir):
    # Each layer split over the group's 2 ranks (TorchTitan's TP): a heal moves each rank's own
    # TP shards, and the norms every TP rank holds whole are sent to each of them.
    run = train(run_dir, "replicas=2", "procs_per_replica=2", "training.tensor_parallel=2", "steps=20",
                "faults=kill@5:1", env={test_hooks.STEP_PAUSE_ENV: "0.25"})
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["outcome"]["status"] == "ok" and s["committed_steps"] == 20 and s["lost_replicas"] == []
    [fault] = s["faults"]
    assert fault["recovered_from"] == "peer" and fault["rejoined_s"] is not None
    assert fault["heal_bytes"] >= 12 * RECIPES["llama3_tiny"].params
    digests = s["final_param_digest"]
    assert sorted(digests) == ["0", "1"] and len(set(digests.values())) == 1


def test_segfault_recovers_from_warm_standby(run_dir):
    run = train(run_dir, "replicas=3", "steps=40", "faults=segfault@15:2")
    fault = assert_recovered(run, "segfault", replica=2, replicas=3)
    # TorchFT gives each rank its own source (round-robin from the group rank): the two ranks'
    # heals come from both survivors, and every byte is accounted to one of them.
    [rejoined] = [e for e in run.events if e["event"] == "replica_rejoined"]
    served = {e["replica"] for e in run.events if e["event"] == "heal_served" and e["step"] > 15}
    assert served == {0, 1}, "both survivors served a share of the heal"
    assert len(rejoined["heal_sources"]) == 2 and all(n > 0 for n in rejoined["heal_sources"].values())
    assert sum(rejoined["heal_sources"].values()) >= fault["heal_bytes"], "every byte came from some source"
    restarted = [e for e in run.events if e["event"] == "replica_started" and e["generation"] > 0]
    assert [(e["replica"], e["from_standby"]) for e in restarted] == [(2, True)]
    assert "segfault -> replica 2" in run.output and "rejoined" in run.output
    # The run's report: rendered at the end, again by `monarch-sky report`, and sent to W&B.
    report = subprocess.run([sys.executable, "-m", "monarch_sky", "report", str(run.path)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "| segfault | 2 |" in report.stdout and (run.path / "timeline.png").stat().st_size > 0
    wandb_files = run.path / "wandb"
    assert list(wandb_files.rglob("media/images/report/timeline_*.png"))
    assert list(wandb_files.rglob("media/table/faults_*.table.json"))


@pytest.mark.e2e
def test_diloco_rejoiner_waits_for_a_sync_further_away_than_the_quorum_timeout(run_dir):
    # The next sync is ~50 steps after the respawn, further away than TorchFT's quorum timeout
    # of 3 s at this model's step time: a rejoiner that asked for its quorum at once would
    # fail again and again. (The timeout still leaves room for a survivor's last inner step
    # on a loaded machine.)
    run = train(
        run_dir, "replicas=2", "steps=120", "ft.mode=diloco", "ft.sync_steps=60",
        "ft.quorum_timeout_s=3", "faults=kill@61:0",
    )
    assert_recovered(run, "kill", replica=0, replicas=2)
    assert run.summary["ft_mode"] == "diloco" and run.summary["heal_transport"] == "tcp"  # auto, in DiLoCo too
    assert run.summary["restarts"] == {"0": 1, "1": 0}, "the rejoiner was declared failed again"
    [rejoined] = [e for e in run.events if e["event"] == "replica_rejoined"]
    assert rejoined["step"] == 120, f"DiLoCo heals at the next sync, not at step {rejoined['step']}"
    [waited] = [e for e in run.events if e["event"] == "rejoin_joined_sync"]
    # The premise in steps, not seconds (a wall-time premise fails on a faster machine): the
    # rejoiner stood by while the survivor trained on towards the sync, instead of asking
    # for a quorum the survivor would only answer at that sync.
    assert waited["waited_steps"] >= 10, f"test premise: the rejoiner must wait out survivor steps: {waited}"


@pytest.mark.e2e
def test_a_diloco_group_that_misses_a_sync_without_a_restart_heals_to_the_same_weights(run_dir):
    # Replica 1's commit of the sync at step 15 is refused after the sync's all-reduce, while
    # replica 0 commits it: replica 1 falls behind without a restart, trains its interval again
    # and heals at the sync at step 20 from replica 0, whose state holds inner-trained weights
    # and the originals of step 15. It must end with replica 0's weights. (Checked: it does
    # with and without resetting to the healed originals, since the outer step applies to the
    # originals; the reset keeps its pseudo-gradient at zero, as a rejoiner's, instead of a copy
    # of replica 0's counted twice in the outer average.)
    from monarch_sky.common.test_hooks import REFUSE_COMMIT_ENV

    run = train(run_dir, "replicas=2", "procs_per_replica=1", "steps=40", "ft.mode=diloco", "ft.sync_steps=5",
                "faults=none", env={REFUSE_COMMIT_ENV: "1:15"})
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["uncommitted_steps"]["1"] > 0 and s["restarts"] == {"0": 0, "1": 0}, "test premise: a sync missed in place"
    healed = [json.loads(line) for line in (run.path / "steps.jsonl").read_text().splitlines()]
    assert any(x["replica"] == 1 and x["committed"] and x["loss"] is None for x in healed), "it healed in place"
    assert len(set(s["final_param_digest"].values())) == 1, s["final_param_digest"]


@pytest.mark.e2e  # the non-default transport; the fast suite heals over tcp
def test_a_kill_heals_over_torchfts_http_transport_too(run_dir):
    run = train(run_dir, "replicas=2", "steps=40", "faults=kill@10:1", "ft.heal_transport=http")
    assert_recovered(run, "kill", replica=1, replicas=2)
    assert run.summary["heal_transport"] == "http"


def test_a_kill_heals_through_monarchs_rdma_buffers(run_dir):
    # No RDMA adapter here: Monarch reads the buffers over its TCP fallback, the same one-sided
    # reads an ibverbs node does in hardware.
    run = train(run_dir, "replicas=2", "steps=40", "faults=kill@10:1", "ft.heal_transport=rdma")
    assert_recovered(run, "kill", replica=1, replicas=2)
    [rejoined] = [e for e in run.events if e["event"] == "replica_rejoined"]
    assert rejoined["heal_transport"].startswith("rdma ("), rejoined


@pytest.mark.e2e
def test_a_heal_three_times_longer_than_the_transports_timeout_fails_no_group(run_dir):
    # Test settings: every bound of the heal transport is 1 s, and the serving side sends its
    # ~1.4 MB per connection at 0.4 MB/s, so the heal lasts ~3.5 s. Nothing may time out.
    hooks = {"MONARCH_SKY_TEST_HEAL_TIMEOUT_S": "1", "MONARCH_SKY_TEST_HEAL_PACE": "400000"}
    run = train(run_dir, "replicas=2", "steps=40", "faults=kill@10:1", env=hooks)
    fault = assert_recovered(run, "kill", replica=1, replicas=2)
    assert fault["heal_s"] > 3 * 1, f"test premise: the heal outlasts the transport's 1 s bounds three times: {fault}"
    assert run.summary["restarts"] == {"0": 0, "1": 1}, "a group failed during the long heal"
    assert fault["survivors_pause_s"] is not None, "the survivors' pause during the heal is recorded"


def test_rejoin_is_recorded_only_when_a_commit_with_the_peers_succeeds(run_dir):
    # The respawned group heals, but its first commit is refused (test hook): that step is
    # not its rejoin. It heals again at the next quorum and commits then.
    hook = {"MONARCH_SKY_TEST_REFUSE_REJOIN_COMMIT": "1"}
    run = train(run_dir, "replicas=2", "steps=40", "faults=kill@10:1", env=hook)
    assert_recovered(run, "kill", replica=1, replicas=2)
    [refused] = [e for e in run.events if e["event"] == "rejoin_step_not_committed"]
    [rejoined] = [e for e in run.events if e["event"] == "replica_rejoined"]
    assert refused["replica"] == rejoined["replica"] == 1
    assert rejoined["step"] > refused["step"], (refused, rejoined)
    assert run.summary["uncommitted_steps"]["1"] >= 1


def test_groups_with_different_weights_fail_the_run(run_dir):
    # Negative control for the digest check: replica 1 starts with different weights.
    hook = {"MONARCH_SKY_TEST_PERTURB_REPLICA": "1"}
    run = train(run_dir, "replicas=2", "steps=5", "faults=none", "ft.standby=false", env=hook)
    assert run.returncode == 4, run.output[-3000:]
    s = run.summary
    assert s["committed_steps"] == 5
    assert len(set(s["final_param_digest"].values())) == 2
    assert s["outcome"]["status"] == "diverged"
    assert "DIFFER" in run.output and "diverged (exit 4)" in run.output
    assert run.leftovers == []


@pytest.mark.e2e  # ~3 min; make chaos also heals hosts on a spare
def test_host_loss_with_a_spare_rejoins_on_the_warm_spare_and_the_pool_refills(run_dir):
    # The warm-up step GPUs take (`auto`) is run here too: it must leave the spare's processes
    # fit to train, with weights that end equal to their peers'.
    run = train(run_dir, "replicas=2", "steps=250", "faults=host@20:1", "hosts.spares=1", "hosts.provision_delay_s=2",
                "hosts.spare_warm_up=always")
    fault = assert_recovered(run, "host", replica=1, replicas=2)
    assert fault["rank"] is None, "a host fault takes every rank"
    assert fault["steps_while_down"] > 0, "survivors committed no step while the host was gone"
    [lost] = [e for e in run.events if e["event"] == "host_lost"]
    [replaced] = [e for e in run.events if e["event"] == "host_replaced"]
    first, refill = [e for e in run.events if e["event"] == "spare_ready"]
    assert replaced["spare"] and replaced["warm"] and replaced["host"] == first["host"], "the group took the warm spare"
    assert fault["host_replaced"]["spare"] is True
    assert refill["host"] not in (lost["host"], first["host"]), "the pool got a new host in place of the lost one"
    assert first["warm_up_step_s"] > 0 and refill["warm_up_step_s"] > 0, "each spare ran its warm-up step"
    [rejoined] = [e for e in run.events if e["event"] == "replica_rejoined"]
    started = {(e["replica"], e["generation"]): e for e in run.events if e["event"] == "replica_started"}
    assert started[(1, rejoined["generation"])]["from_standby"], "the spare's processes were already up"
    assert started[(1, rejoined["generation"])]["hosts"] == [first["host"]]
    assert run.summary["spares"] == {"size": 1, "used": 1, "ready": 1, "warm": True}


@pytest.mark.e2e
def test_a_second_host_loss_while_the_pool_refills_takes_the_refill_in_flight(run_dir):
    # One spare, a 40 s provider: group 0's loss takes the spare and the pool orders a refill;
    # group 1's loss, 15 steps (here 15-20 s) later, finds no spare ready and claims that refill
    # (ordered before its own could be) instead of ordering a host; the pool orders another.
    run = train(run_dir, "replicas=3", "steps=200", "faults=host@10:0,host@25:1", "hosts.spares=1",
                "hosts.provision_delay_s=40")
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == [], s
    assert [(f["replica"], f["recovered_from"]) for f in s["faults"]] == [(0, "peer"), (1, "peer")], s["faults"]
    assert [f["host_replaced"]["spare"] for f in s["faults"]] == [True, False]
    claims = [e for e in run.events if e["event"] == "spare_refill_claimed"]
    assert [e["replica"] for e in claims] == [1], claims
    assert len(set(s["final_param_digest"].values())) == 1 and len(s["final_param_digest"]) == 3
    assert s["spares"]["used"] == 1
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e
def test_a_second_host_loss_while_the_refill_warms_waits_for_that_spare_not_a_new_host(run_dir):
    # One spare; a refill's warm-up is made 40 s longer (test hook), so group 1's loss, 15
    # steps after group 0's, lands while the refill is warming. It claims that spare and
    # waits for it instead of ordering a host, and the pool orders another for itself.
    hook = {"MONARCH_SKY_TEST_REFILL_WARM_DELAY_S": "40"}
    run = train(run_dir, "replicas=3", "steps=200", "faults=host@10:0,host@25:1", "hosts.spares=1",
                "hosts.provision_delay_s=1", env=hook)
    assert run.returncode == 0, run.output[-4000:]
    s = run.summary
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == [], s
    assert [(f["replica"], f["recovered_from"]) for f in s["faults"]] == [(0, "peer"), (1, "peer")], s["faults"]
    assert [f["host_replaced"]["spare"] for f in s["faults"]] == [True, True], "group 1 ordered a host of its own"
    [claim] = [e for e in run.events if e["event"] == "spare_warming_claimed"]
    [delivered] = [e for e in run.events if e["event"] == "spare_ready" and "claimed_by" in e]
    assert claim["replica"] == delivered["claimed_by"] == 1 and claim["host"] == delivered["host"]
    replaced = [e for e in run.events if e["event"] == "host_replaced" and e["replica"] == 1]
    assert [e["host"] for e in replaced] == [claim["host"]]
    assert not [e for e in run.events if e["event"] == "spare_refill_claimed"]
    assert s["spares"]["used"] == 2
    assert len(set(s["final_param_digest"].values())) == 1 and len(s["final_param_digest"]) == 3
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e
def test_group_spanning_two_hosts_loses_one_and_heals_on_a_spare(run_dir):
    # Each group is one FSDP mesh over two hosts; the host fault takes one of group 1's, and
    # the spare host takes its place (attached, not warm: a spare holds no part of a group).
    run = train(run_dir, "replicas=2", "hosts_per_replica=2", "procs_per_replica=1", "steps=100",
                "faults=host@15:1", "hosts.provision_delay_s=1", "hosts.spares=1")
    assert_recovered(run, "host", replica=1, replicas=2)  # the heal carried all of both ranks' shards
    [ready] = [e for e in run.events if e["event"] == "hosts_ready"]
    assert len(ready["hosts"]) == 4
    started = {(e["replica"], e["generation"]): e["hosts"] for e in run.events if e["event"] == "replica_started"}
    assert started[(0, 0)] == ready["hosts"][:2] and started[(1, 0)] == ready["hosts"][2:]
    [lost] = [e["host"] for e in run.events if e["event"] == "host_lost"]
    [replaced] = [e["host"] for e in run.events if e["event"] == "host_replaced"]
    [spare] = [e for e in run.events if e["event"] == "spare_ready"][:1]
    assert (replaced, spare["warm"]) == (spare["host"], False)
    assert lost in started[(1, 0)]
    rejoined = [e for e in run.events if e["event"] == "replica_rejoined"][-1]
    kept_and_new = [replaced if h == lost else h for h in started[(1, 0)]]
    assert started[(1, rejoined["generation"])] == kept_and_new, "only the lost host is replaced"
    assert run.summary["hosts_per_replica"] == 2


@pytest.mark.e2e
def test_replacement_host_never_arrives_training_finishes_without_it(run_dir):
    run = train(
        run_dir, "replicas=2", "steps=60", "faults=host@15:1",
        "hosts.provision_delay_s=600", "hosts.provision_timeout_s=2",
    )
    assert run.returncode == 3, run.output[-4000:]
    s = run.summary
    assert s["outcome"]["status"] == "degraded"
    assert s["committed_steps"] == 60
    assert s["unplanned_failures"] == []
    [lost] = s["lost_replicas"]
    assert lost["replica"] == 1 and "no replacement" in lost["reason"], lost
    assert s["restarts"]["0"] == 0, "the survivor was never restarted"
    [fault] = s["faults"]
    assert fault["rejoined_s"] is None and fault["recovered_from"] is None
    assert list(s["final_param_digest"]) == ["0"], "only the survivor finished"
    assert "replica 1 was lost" in run.output and "1 of 2 groups reported" in run.output
    assert "all equal" not in run.output
    assert run.leftovers == [], run.leftovers


def run_with_provider(run_dir, kind: str, *overrides: str, timeout_s: float = 600) -> Run:
    """`monarch-sky train` with a misbehaving host provider from tests/providers.py."""
    tag = new_tag()
    proc = subprocess.run(
        [sys.executable, "tests/providers.py", kind, f"run_dir={run_dir}", f"run_id={tag}", *overrides],
        cwd=REPO, env=cli_env(tag), capture_output=True, text=True, timeout=timeout_s,
    )
    return Run(proc.returncode, proc.stdout + proc.stderr, run_dir / tag, leftovers(tag))


def test_a_provider_error_during_respawn_costs_only_that_group_a_restart(run_dir):
    run = run_with_provider(run_dir, "fails-once", "replicas=2", "steps=120", "faults=host@15:1",
                            "hosts.provision_delay_s=1")
    assert_recovered(run, "host", replica=1, replicas=2)
    assert run.summary["restarts"] == {"0": 0, "1": 2}, "one restart for the host, one for the provider error"
    [error] = [e for e in run.events if e["event"] == "recovery_error"]
    assert error["replica"] == 1 and "provider API error 500" in error["error"]


@pytest.mark.e2e
def test_a_provider_call_that_never_returns_does_not_hold_the_run(run_dir):
    # The replacement host never comes and the provider call cannot be interrupted: the run
    # must still end (the test's timeout is far below the provider's hour).
    run = run_with_provider(run_dir, "never-answers", "replicas=2", "steps=30", "faults=host@10:1",
                            "hosts.provision_timeout_s=3000", timeout_s=400)
    assert run.returncode == 3, run.output[-3000:]
    [lost] = run.summary["lost_replicas"]
    assert lost["replica"] == 1 and "finished before it rejoined" in lost["reason"]
    assert run.summary["committed_steps"] == 30
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e
def test_a_replacement_host_that_dies_during_the_build_is_replaced_in_turn(run_dir):
    # The first replacement dies while the group's new generation spawns on it: the build
    # sees it (it does not wait out timeouts.spawn_s) and the group moves to another host.
    run = run_with_provider(run_dir, "dies-on-arrival", "replicas=2", "steps=150", "faults=host@15:1",
                            "hosts.provision_delay_s=1")
    assert_recovered(run, "host", replica=1, replicas=2)
    replaced = [e["host"] for e in run.events if e["event"] == "host_replaced"]
    assert len(replaced) == 2 and len(set(replaced)) == 2, replaced
    [failed_start] = [e for e in run.events if e["event"] == "replica_start_failed"]
    assert "died while generation" in failed_start["reason"] or "unreachable" in failed_start["reason"], failed_start
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e
def test_a_spare_that_dies_while_idle_is_replaced_and_a_later_host_loss_still_heals(run_dir):
    # The spare dies two seconds after it is ready, long before the host fault.
    run = run_with_provider(run_dir, "spare-dies-idle", "replicas=2", "steps=250", "faults=host@120:1",
                            "hosts.spares=1", "hosts.provision_delay_s=1")
    assert_recovered(run, "host", replica=1, replicas=2)
    first = next(e for e in run.events if e["event"] == "spare_ready")
    [dropped] = [e for e in run.events if e["event"] == "spare_lost"]
    assert dropped["host"] == first["host"] and not dropped["host_alive"], "the dead idle spare was noticed"
    assert dropped["reason"] == "its host died while idle"
    ready = [e for e in run.events if e["event"] == "spare_ready" and e["t"] > dropped["t"]]
    assert ready and ready[0]["host"] != dropped["host"], "and replaced"
    [replaced] = [e for e in run.events if e["event"] == "host_replaced"]
    assert replaced["host"] != dropped["host"], "the dead spare was never handed to a group"
    assert run.summary["restarts"]["0"] == 0


@pytest.mark.e2e
def test_a_spare_that_dies_during_promotion_costs_one_retry_on_the_next_spare_not_the_group(run_dir):
    # Two spares; the first one taken dies while the group's generation builds on it.
    run = run_with_provider(run_dir, "spare-dies-on-promotion", "replicas=2", "steps=200", "faults=host@60:1",
                            "hosts.spares=2", "hosts.provision_delay_s=1")
    assert_recovered(run, "host", replica=1, replicas=2)
    replaced = [e for e in run.events if e["event"] == "host_replaced"]
    assert [e["spare"] for e in replaced[:2]] == [True, True], replaced
    first, second = replaced[0]["host"], replaced[1]["host"]
    assert first != second, "the group moved to the other spare"
    lost = [e["host"] for e in run.events if e["event"] == "host_lost"]
    assert lost[1:2] == [first], "the promoted spare was named lost, not the group"
    assert run.summary["lost_replicas"] == [] and run.summary["restarts"]["0"] == 0
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e
def test_a_replacement_slower_than_the_wait_is_used_by_the_retry_not_ordered_again(run_dir):
    # The provider takes 3.5 s and the slot waits 2 s at a time: a retry waits for the same
    # request (a new request per try would never come in time), so the group rejoins on the
    # one host it ordered.
    run = train(run_dir, "replicas=2", "steps=150", "faults=host@15:1",
                "hosts.provision_delay_s=3.5", "hosts.provision_timeout_s=2")
    assert_recovered(run, "host", replica=1, replicas=2)
    events = [e["event"] for e in run.events]
    assert "host_replacement_failed" in events and events.count("host_replaced") == 1
    assert events.count("host_lost") == 1 and "still waiting for a host in place of local-1" in run.output
    workers = sorted(p.name for p in (run.path / "hosts").glob("local-*.log"))
    assert workers == ["local-0.log", "local-1.log", "local-2.log"], "one replacement host, no more"
