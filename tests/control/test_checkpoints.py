"""The last-resort checkpoints' files: finding the newest, notes, leftovers, the interval."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from monarch_sky.common import checkpoints
from monarch_sky.control.checkpoint_resume import (
    SHAPE, CheckpointMismatch, attempt_from_checkpoint, fingerprint, fired_before, restart_message, resume_from,
)
from monarch_sky.config import load_job


def make_step(folder, step: int, complete: bool = True, note: dict | None = None) -> None:
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (path / ".metadata").write_bytes(b"m")
    if note is not None:
        checkpoints.write_note(folder, step, note)


def test_newest_is_the_highest_step_with_metadata_and_note(tmp_path):
    make_step(tmp_path, 5, note={"a": 1})
    make_step(tmp_path, 40, note={"a": 2})
    make_step(tmp_path, 100, note={"a": 3})
    make_step(tmp_path, 120, complete=False, note={"a": 4})  # DCP never finished it
    make_step(tmp_path, 130)  # finished, but the controller died before its note
    (tmp_path / "step-9.json").write_text("{}")  # not a folder
    (tmp_path / "other").mkdir()
    found = checkpoints.newest(tmp_path)
    assert (found.step, found.path.name, found.note["a"]) == (100, "step-100", 3)
    assert [s for s, _ in checkpoints.step_dirs(tmp_path)] == [5, 40, 100, 120, 130]


def test_a_checkpoint_set_aside_is_seen_by_neither_the_run_nor_torchtitans_purge(tmp_path):
    import re

    make_step(tmp_path, 10, note={"step": 10})
    make_step(tmp_path, 20, note={"step": 20})
    moved = checkpoints.set_aside(checkpoints.newest(tmp_path))
    assert moved.name == "unreadable-20" and (moved / "__0_0.distcp").is_file(), "kept for a look"
    assert checkpoints.newest(tmp_path).step == 10
    assert not any(re.search(r"step-(\d+)", p.name) for p in [moved])  # TorchTitan's purge pattern
    assert checkpoints.newest(tmp_path, skip=frozenset({10})) is None


def test_a_start_that_failed_on_a_checkpoint_says_which_step_from_anywhere_in_the_report():
    report = ("SupervisionError: Endpoint call r0g1-replica.setup() failed\n  Traceback (most recent call last):\n"
              "    File x\n  monarch_sky.replica.trainer_checkpoint.CheckpointUnreadable: cannot load the checkpoint "
              "step-48: CheckpointException: EOFError\n  more")
    assert checkpoints.unreadable(report) == (48, "cannot load the checkpoint step-48: CheckpointException: EOFError")
    assert checkpoints.unreadable("RuntimeError: no checkpoint at step 48") is None


def test_the_faults_a_run_fired_are_read_back_from_its_checkpoint_folder_a_line_cut_short_skipped(tmp_path):
    assert checkpoints.faults_fired(tmp_path) == []
    for spec in ("kill@8:1", "controller@25"):
        checkpoints.note_fault_fired(tmp_path / "run", spec)
    with open(tmp_path / "run" / checkpoints.FAULTS_FIRED, "a") as f:
        f.write('"host@3')  # the process died mid-write
    assert checkpoints.faults_fired(tmp_path / "run") == ["kill@8:1", "controller@25"]
    assert checkpoints.newest(tmp_path / "run") is None, "the list is no checkpoint"


def test_a_new_pod_knows_the_faults_fired_before_any_checkpoint_and_merges_both_lists(tmp_path):
    cfg = job(tmp_path, "checkpoint.every_min=1")
    folder = checkpoints.folder_for(cfg)
    assert attempt_from_checkpoint(cfg) is None
    checkpoints.note_fault_fired(folder, "controller@5")  # fired before the first save
    previous = attempt_from_checkpoint(cfg)
    assert previous["faults_fired"] == ["controller@5"] and previous["last_step"] == 0, previous
    # A record from the second pod lacks the first pod's firing; the folder has both.
    checkpoints.note_fault_fired(folder, "kill@8:1")
    merged = fired_before(cfg, {"faults_fired": ["kill@8:1", "kill@8:1"]})
    assert sorted(merged) == ["controller@5", "kill@8:1", "kill@8:1"], merged


def test_no_checkpoint(tmp_path):
    assert checkpoints.newest(tmp_path / "absent") is None
    make_step(tmp_path, 3, complete=False, note={})
    assert checkpoints.newest(tmp_path) is None


def test_a_note_for_another_step_is_not_trusted(tmp_path):
    make_step(tmp_path, 7)
    (tmp_path / "step-7" / checkpoints.NOTE).write_text(json.dumps({"step": 6}))
    assert checkpoints.newest(tmp_path) is None


def test_discard_newer_removes_what_a_dead_attempt_left_above_the_resume_step(tmp_path):
    for step in (10, 20, 30):
        make_step(tmp_path, step, note={})
    make_step(tmp_path, 35, complete=False)
    assert checkpoints.discard_newer(tmp_path, 20) == ["step-30", "step-35"]
    assert [s for s, _ in checkpoints.step_dirs(tmp_path)] == [10, 20]


def test_notes_round_trip_dataloader_bytes(tmp_path):
    data = {"0": [{"dp_rank_0": b"\x80\x04pickled", "world_size": 2}, {"dp_rank_1": b"", "world_size": 2}]}
    path = checkpoints.write_note(tmp_path, 12, {"data_states": data})
    assert path == tmp_path / "step-12" / checkpoints.NOTE
    assert [p.name for p in path.parent.iterdir()] == [checkpoints.NOTE]  # no temporary left
    note = checkpoints.decode(json.loads(path.read_text()))
    assert note == {"data_states": data, "step": 12}


@pytest.mark.parametrize("cost_s,share,minutes", [(0.6, 0.01, 1.0), (6.0, 0.01, 10.0), (3.0, 0.05, 1.0), (0.0, 0.01, 0.0)])
def test_interval_costs_the_share_asked_for(cost_s, share, minutes):
    assert checkpoints.interval_min(cost_s, share) == pytest.approx(minutes)
    if minutes:
        assert cost_s / (60 * minutes) == pytest.approx(share)


def test_interval_refuses_nonsense():
    with pytest.raises(ValueError):
        checkpoints.interval_min(1.0, share=0)


def job(tmp_path, *overrides):
    return load_job([f"run_dir={tmp_path}", "run_id=r1", "replicas=2", "faults=none", *overrides]).config


def test_the_default_folder_is_under_the_run_record_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_job(["run_dir=runs", "run_id=r1"]).config
    assert checkpoints.folder_for(cfg) == tmp_path / "runs" / "r1" / "checkpoints"
    cfg = load_job(["run_id=r1", "checkpoint.folder=/mnt/bucket/ck"]).config
    assert str(checkpoints.folder_for(cfg)) == "/mnt/bucket/ck/r1", "a folder per run in a shared bucket"


def test_a_restart_resumes_from_the_newest_and_says_what_was_lost(tmp_path):
    cfg = job(tmp_path)
    folder = checkpoints.folder_for(cfg)
    shape = {"recipe": "llama3_tiny", "replicas": 2, "procs_per_replica": 2}
    make_step(folder, 20, note=shape)
    make_step(folder, 30, note=shape)
    make_step(folder, 40, complete=False)
    previous = {"last_step": 37, "ended": "controller lost", "reaped_processes": 6}
    found = resume_from(cfg, previous)
    assert found.step == 30
    assert (previous["resumed_from_step"], previous["steps_lost"], previous["discarded_checkpoints"]) == (30, 7, ["step-40"])
    message = restart_message("r1", previous)
    assert "Resumed from the checkpoint at step 30; lost 7 steps (the last recorded step was 37)" in message


def test_a_restart_without_a_checkpoint_says_so(tmp_path):
    previous = {"last_step": 12, "ended": "controller lost", "reaped_processes": 0}
    assert resume_from(job(tmp_path), previous) is None
    assert previous["resumed_from_step"] is None
    assert "There is no checkpoint: the run goes on from the newest state its hosts hold in node memory, if any, else from step 0" in restart_message("r1", previous)


def test_a_checkpoint_of_another_shape_is_refused_and_kept(tmp_path):
    cfg = job(tmp_path, "procs_per_replica=1")
    make_step(checkpoints.folder_for(cfg), 20, note={"recipe": "llama3_tiny", "replicas": 2, "procs_per_replica": 2})
    previous = {"last_step": 25, "ended": "controller lost", "reaped_processes": 0}
    with pytest.raises(CheckpointMismatch) as e:
        resume_from(cfg, previous)
    assert "procs_per_replica=2" in str(e.value) and "procs_per_replica=1" in str(e.value)
    assert checkpoints.newest(checkpoints.folder_for(cfg)).step == 20, "the checkpoint stays"


def test_a_checkpoint_saved_under_other_settings_names_each_one_and_the_fix(tmp_path):
    saved = job(tmp_path)
    note = fingerprint(saved)
    note = {**{k: note.pop(k) for k in SHAPE}, "settings": note, "run_id": "r1"}
    make_step(checkpoints.folder_for(saved), 20, note=note)
    changed = job(tmp_path, "training.lr=0.5", "steps=999", "data.dataset=c4")
    with pytest.raises(CheckpointMismatch) as e:
        resume_from(changed, {"last_step": 25})
    said = str(e.value)
    for key in ("training.lr", "steps", "data.dataset"):
        assert f"{key}={OmegaConf.select(saved, key)}" in said and f"{key}={OmegaConf.select(changed, key)}" in said
    assert "seq_len" not in said, "only the fields that differ"
    assert "Run again with the saved values" in said and "new run_id" in said
    previous = {"last_step": 25}
    assert resume_from(job(tmp_path), previous).step == 20, "the same settings resume"
    assert previous["resumed_from_step"] == 20


def test_a_checkpoint_of_another_run_is_refused_and_kept(tmp_path):
    cfg = job(tmp_path)
    note = {"run_id": "someone-else", "recipe": "llama3_tiny", "replicas": cfg.replicas,
            "procs_per_replica": cfg.procs_per_replica, "hosts_per_replica": cfg.hosts_per_replica}
    make_step(checkpoints.folder_for(cfg), 20, note=note)
    with pytest.raises(CheckpointMismatch, match="belongs to run someone-else"):
        resume_from(cfg, {"last_step": 25})
    assert checkpoints.newest(checkpoints.folder_for(cfg)).step == 20, "nor deleted"


def load_cost_tool():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("checkpoint_cost", REPO / "tools" / "checkpoint_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cost_tool_charges_each_save_the_slowdown_of_the_steps_after_it():
    tool = load_cost_tool()
    # Steps every 1.0 s; saves after steps 20 and 40 make the next step 0.5 s late and the
    # one after 0.25 s late (the background write).
    late = {21: 0.5, 22: 0.25, 41: 0.5, 42: 0.25}
    wall, steps = 0.0, []
    for step in range(1, 61):
        wall += 1.0 + late.get(step, 0.0)
        steps += [{"replica": r, "step": step, "committed": True, "wall": wall + 0.01 * r} for r in (0, 1)]
    events = [{"event": "checkpoint_staged", "replica": 0, "step": s, "blocking_s": 0.4, "waited_s": 0.45} for s in (20, 40)]
    got = tool.analyze(events, steps)
    assert got["saves"] == 2 and got["blocking_s"] == 0.4 and got["save_call_s"] == 0.45
    assert got["step_gap_s"] == pytest.approx(1.0)
    assert got["extra_s_per_save"] == pytest.approx(0.75)
    assert got["step_ratio_after_save"] == pytest.approx(1.25)
    with pytest.raises(ValueError, match="no checkpoint was saved"):
        tool.analyze([], steps)


def test_checkpoints_are_off_locally_and_on_in_the_cloud_recipes():
    from omegaconf import OmegaConf

    from monarch_sky.config import JobConfig
    from monarch_sky.recipes import RECIPES

    def every_min(recipe: str) -> float:
        return OmegaConf.merge(OmegaConf.structured(JobConfig), RECIPES[recipe].job_defaults).checkpoint.every_min

    assert every_min("llama3_tiny") == every_min("llama3_debug") == 0
    assert 0 < every_min("llama3_8b") < every_min("llama3_70b")
