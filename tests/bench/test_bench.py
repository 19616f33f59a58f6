"""`make bench`: the arms' numbers, and a tiny bench end to end (behind `make chaos`)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from monarch_sky.bench import metrics
from monarch_sky.bench.outside_chaos import OutsideChaos
from monarch_sky.bench.report import bench_markdown
from monarch_sky.bench.runner import RATIOS, ratio_spread
from monarch_sky.record.jsonl import JsonlTail, read_jsonl

REPO = Path(__file__).resolve().parents[2]


def line(wall, step, replica=-1, committed=True, seconds=1.0, loss=1.0):
    return {"wall": wall, "replica": replica, "step": step, "committed": committed, "seconds": seconds,
            "loss": loss, "participants": 1}


def test_a_restart_from_a_checkpoint_keeps_only_the_last_run_of_each_step():
    # One job: steps 1-4, killed at t=4.5, restarted from the step-2 checkpoint at t=10.
    lines = [line(t, t) for t in (1, 2, 3, 4)] + [line(11, 3), line(12, 4), line(13, 5)]
    stats = metrics.arm_stats(lines, started=0.0, ended=14.0, target=5)
    assert stats["attempted_steps"] == 7
    assert stats["step_efficiency"] == round(5 / 7, 4)  # steps 3 and 4 ran twice
    assert stats["goodput"] == round(5 / 14, 4)
    assert stats["time_to_target_s"] == 13.0
    assert stats["work_rate"] == round(5 / 13, 4)  # kept steps 1, 2, 3, 4, 5 by the target
    assert stats["committed_steps"] == 5
    fault = {"wall": 4.5, "kind": "kill", "replica": 0, "restarted_wall": 10.0}
    times = metrics.fault_times(fault, lines, single_job=True)
    assert times["resumed_s"] == 11 - 4.5  # the first step begun after the restart
    assert times["regained_s"] == 13 - 4.5  # past step 4, where the run was when it failed


def test_the_time_between_a_groups_steps_is_what_its_steps_do_not_cover():
    # Replica 0: steps of 1 s ending at 1, 2.1, 3.3 (0.1 and 0.2 s outside them); replica 1 also
    # fails step 3, so its step 4 does not follow a committed step 3 and is left out.
    lines = [line(1, 1, 0), line(2.1, 2, 0), line(3.3, 3, 0), line(1, 1, 1), line(2.3, 2, 1),
             line(3.3, 3, 1, committed=False), line(4.3, 4, 1)]
    assert metrics.between_steps(lines) == round(statistics.median([0.1, 0.2, 0.3]), 4)


def test_the_steady_step_leaves_out_the_runs_first_half():
    # Two groups of 10 steps: 2 s a step while start-up work shares the cores, then 1 s (group 0)
    # and 1.5 s (group 1) over the second half (steps 6-10).
    lines = []
    for replica, late in ((0, 1.0), (1, 1.5)):
        wall = 0.0
        for step in range(1, 11):
            wall += 2.0 if step <= 5 else late
            lines.append(line(wall, step, replica))
    assert metrics.arm_stats(lines, 0.0, 30.0, target=10)["steady_step_s"] == statistics.median([1.0, 1.5])


def test_survivors_resume_before_the_failed_group_rejoins():
    lines = [line(t, t, replica=r) for t in (1, 2) for r in (0, 1)]
    lines += [line(3.2, 3, replica=0, committed=False), line(4.5, 3, replica=0, seconds=1.0), line(5.5, 4, replica=0)]
    lines += [line(7.5, 4, replica=1, seconds=1.0), line(8.5, 5, replica=1), line(8.5, 5, replica=0)]
    fault = {"wall": 2.5, "kind": "kill", "replica": 1, "restarted_wall": 6.0}
    times = metrics.fault_times(fault, sorted(lines, key=lambda x: x["wall"]), single_job=False)
    assert times["resumed_s"] == 4.5 - 2.5
    assert times["rejoined_s"] == 7.5 - 2.5
    kinds = metrics.by_kind([("kill", times), ("kill", {**times, "resumed_s": 4.0})])
    assert kinds["kill"]["count"] == 2 and kinds["kill"]["resumed_s"]["max"] == 4.0


def test_a_growing_steps_file_is_read_once_and_a_line_waits_for_its_end(tmp_path):
    path = tmp_path / "steps.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []
    path.write_text(json.dumps(line(2, 2)) + "\n" + json.dumps(line(1, 1)) + "\n" + '{"wall": 3, "rep')
    assert [x["step"] for x in tail.read()] == [1, 2]  # by wall time; the unended line waits
    with open(path, "a") as f:
        f.write('lica": -1, "step": 3, "committed": true, "seconds": 1, "loss": 1, "participants": 1}\n')
    assert [x["step"] for x in tail.read()] == [1, 2, 3]
    assert read_jsonl(path) == tail.lines


def test_a_restarting_single_job_meets_no_faults_until_it_trains_again(tmp_path):
    """Checkpoint-restart's fault clock stops while it restarts, so every arm meets faults
    at the same rate per second of training."""
    settings = SimpleNamespace(every_s=1000.0, kinds=["kill"], seed=1, replicas=2, procs=1, steps=100)
    (tmp_path / "steps.jsonl").write_text(json.dumps(line(time.time(), 1)) + "\n")
    chaos = OutsideChaos(tmp_path, settings, launch_of=None, single_job=True)
    chaos.tick()
    first = chaos.next_at
    time.sleep(0.2)
    chaos.tick()
    assert chaos.next_at == first  # training: the clock runs
    chaos.faults.append({"wall": time.time(), "kind": "kill", "replica": 0, "restarted_wall": None})
    time.sleep(0.2)
    chaos.tick()
    assert chaos.next_at >= first + 0.2  # restarting: the next fault moves with the downtime


def test_each_ratio_is_taken_per_round_and_reported_with_its_spread():
    # Round 2 was slow for everyone: the per-round ratios are 2.0, 1.5, 3.0; the ratio of
    # the medians (0.6/0.3) would say 2.0 and hide the spread.
    c = [{"goodput": g, "time_to_target_s": 10.0} for g in (0.6, 0.3, 0.9)]
    d = [{"goodput": g, "time_to_target_s": 20.0} for g in (0.3, 0.2, 0.3)]
    spread = ratio_spread({"C": c, "D": d})
    assert spread["goodput C/D"] == {"median": 2.0, "min": 1.5, "max": 3.0, "rounds": [2.0, 1.5, 3.0]}
    assert spread["time_to_target D/C"]["median"] == 2.0
    assert "goodput C/E" not in spread, "an arm that did not run gives no ratio"
    bench = {"arms": {"E_best": {"label": "E'", "excluded_faults": {"kinds": ["stop", "hang"], "skipped": {"stop": 2}}}},
             "ratios": {name: s and s["median"] for name, s in spread.items()}, "ratio_spread": spread}
    report = bench_markdown(bench)
    assert "- goodput C/D: 2.000 (min 1.500, max 3.000 over 3 rounds)" in report
    assert "E': stop, hang left out" in report and "{'stop': 2}" in report


@pytest.mark.chaos
def test_a_tiny_bench_writes_every_arm_and_ratio(tmp_path):
    """Every arm really trains (no faults in A and B, chaos in C, C', D, E, E') and is reported."""
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_sky", "bench", "--steps", "40", "--replicas", "2", "--procs", "1",
         "--every-s", "3", "--kinds", "kill,host", "--ckpt-interval", "4", "--arm-timeout-s", "300",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=2400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [bench_dir] = tmp_path.iterdir()
    bench = json.loads((bench_dir / "bench.json").read_text())
    assert set(bench["arms"]) == {"A_step", "A_diloco", "B", "C", "C_spare", "D", "E", "E_best"}
    for key, arm in bench["arms"].items():
        # C may end degraded (exit 3): a group hit late can still be coming back at the end.
        assert arm["exit_code"] in ((0, 3) if key in ("C", "C_spare") else (0,)), (key, arm)
        assert arm["committed_steps"] == 40, (key, arm)
        for fld in ("goodput", "work_rate", "step_efficiency", "time_to_target_s", "loss_at_target", "faults"):
            assert arm[fld] is not None, (key, fld)
    assert sum(kind["count"] for arm in ("C", "C_spare", "D", "E", "E_best") for kind in bench["arms"][arm]["faults"].values()) > 0
    ran = {name for name, (a, b, _) in RATIOS.items() if a in bench["arms"] and b in bench["arms"]}
    assert set(bench["ratios"]) == ran and all(v is not None for v in bench["ratios"].values())
    for name in ("bench.md", "steps_vs_time.png", "quorum_C.png"):
        assert (bench_dir / name).stat().st_size > 0
    assert "goodput C/D" in proc.stdout  # the table is printed


@pytest.mark.chaos
def test_two_interleaved_rounds_give_each_ratio_its_spread(tmp_path):
    """`--rounds 2` runs C and E' twice each, interleaved, and reports every ratio as the median of
    the two rounds' pairs with both values, in bench.json and in the printed table."""
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_sky", "bench", "--arms", "C,E_best", "--rounds", "2", "--steps", "40",
         "--replicas", "2", "--procs", "1", "--every-s", "3", "--kinds", "kill", "--arm-timeout-s", "300",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [bench_dir] = tmp_path.iterdir()
    bench = json.loads((bench_dir / "bench.json").read_text())
    assert set(bench["arms"]) == {"C", "E_best"}
    for key, arm in bench["arms"].items():
        assert [run["committed_steps"] for run in arm["rounds"]] == [40, 40], (key, arm["rounds"])
    spread = bench["ratio_spread"]["goodput C/E'"]
    assert len(spread["rounds"]) == 2 and spread["min"] <= spread["median"] <= spread["max"], spread
    assert "over 2 rounds" in proc.stdout


@pytest.mark.chaos
def test_a_tiny_diloco_bench_heals_c_and_e_prime_at_their_syncs(tmp_path):
    """C and E' in `ft.mode=diloco` under kills: both reach the target, E' through TorchTitan's
    own DiLoCo loop with a killed group healed from a peer at a sync, and the DiLoCo ratios
    are reported (only those: the other arms did not run)."""
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_sky", "bench", "--arms", "C_diloco,E_best_diloco", "--steps", "300",
         "--replicas", "2", "--procs", "1", "--every-s", "3", "--kinds", "kill", "--arm-timeout-s", "300",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [bench_dir] = tmp_path.iterdir()
    bench = json.loads((bench_dir / "bench.json").read_text())
    for key, arm in bench["arms"].items():
        assert arm["committed_steps"] == 300 and arm["loss_at_target"] is not None, (key, arm)
        assert sum(kind["count"] for kind in arm["faults"].values()) > 0, (key, "no fault was injected")
    logs = "".join(p.read_text() for p in (bench_dir / "E_best_diloco").glob("replica*.log"))
    assert "healed from a peer" in logs, "no killed E' group healed from a peer"
    assert set(bench["ratios"]) == {"goodput C/E' (diloco)", "work_rate C/E' (diloco)", "time_to_target E'/C (diloco)"}
    assert all(v is not None for v in bench["ratios"].values()), bench["ratios"]


def test_the_scale_sweeps_smallest_point_regroups_without_a_lost_group_and_admits_a_new_one(tmp_path):
    """Against a real lighthouse: every wait ends in the quorum it waits for (a lost group
    out, a new one in), and the regroup waits out the heartbeat timeout it must."""
    from monarch_sky.bench import scale
    from monarch_sky.config import FTSettings

    ft = FTSettings()
    row = scale.measure(2, ft, timeout_s=30)
    assert "failed" not in row, row
    assert row["regroup_s"] >= ft.heartbeat_timeout_ms / 1000 * 0.9, "regrouped before the lost group's heartbeats expired"
    assert all(row[k] > 0 for k in ("quorum_s", "admit_s")), row
    assert scale.main(["--groups", "2,3", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    assert [r["groups"] for r in rows] == [2, 3] and (tmp_path / "scale.png").stat().st_size > 0


def test_the_real_scale_sweeps_smallest_point_heals_the_killed_group(tmp_path):
    """`make bench-scale-groups` at 4 groups: a whole run, its row read from the run record.

    With 4 groups a survivor that is not the dead group's ring neighbour blocks in gloo's recv
    until `ft.process_group_timeout_ms`, and the others' quorum waits `ft.join_timeout_ms` for
    it, unless the neighbours free their failed process group at once
    (`platform.close_links_on_error`). Both are set far above a step, so that survivors which
    waited them out cannot pass for survivors that resumed."""
    from monarch_sky.bench import scale_groups

    wait_s = 60
    assert scale_groups.main(["--groups", "4", "--out", str(tmp_path), "--timeout-s", "900",
                              "--set", f"ft.process_group_timeout_ms={wait_s * 1000}",
                              "--set", f"ft.join_timeout_ms={wait_s * 1000}"]) == 0
    [row] = json.loads((tmp_path / "scale-groups.json").read_text())["rows"]
    assert row["groups"] == 4 and row["digests_equal"], row
    assert row["survivors_resumed_s"] < wait_s / 2, f"the survivors waited for the one stuck in a collective: {row}"
    # The survivors' own TorchFT may commit before the controller hears of the death: no order
    # between detected_s and survivors_resumed_s is promised, only that the respawn follows it.
    assert 0 < row["detected_s"] <= row["rejoined_s"] and row["survivors_resumed_s"] > 0, row
    assert min(row["build_s"], row["first_step_s"], row["step_s"]) > 0, row
    assert row["standby_s"] is None or row["standby_s"] > 0, row  # warmed in the background: maybe not by the end
    assert (tmp_path / "scale-groups.png").stat().st_size > 0
