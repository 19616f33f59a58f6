"""A rank's last-resort checkpoint: TorchTitan's own async checkpointer, healing untouched.

Runs a real TorchTitan trainer (one process, one replica group, a real lighthouse) in a
fresh interpreter, as tests/replica/test_healing.py does.
"""

from __future__ import annotations

import time

from conftest import in_fresh_interpreter, small_disk

from monarch_sky.replica.healing import STATE_KEY


def _save_and_load(tmp: str, queue) -> None:
    from pathlib import Path

    import torch
    from conftest import one_rank_trainer_env

    from monarch_sky.common.checkpoints import CheckpointSpec
    from monarch_sky.config import load_job
    from monarch_sky.recipes import TrainerSpec
    from monarch_sky.replica.trainer import GroupTrainer

    lighthouse = one_rank_trainer_env()
    folder, dump = Path(tmp) / "checkpoints", Path(tmp) / "dump"
    job = load_job(["replicas=1", "procs_per_replica=1", "steps=10", "faults=none"])
    spec = CheckpointSpec(folder=str(folder), async_mode="async", keep=2)
    trainer = GroupTrainer(TrainerSpec.from_job(job.config, 0, str(dump), "cpu", checkpoint=spec))
    healing_fns = sorted(trainer.manager._user_state_dicts)  # what TorchFT would send a rejoining peer
    saves = []
    for _ in range(4):
        r = trainer.step()
        saves.append(trainer.save_checkpoint(r.step))
    refused = trainer.save_checkpoint(3)  # not the step the trainer is at
    trainer.checkpoint.checkpointer.maybe_wait_for_saving()
    deadline = time.monotonic() + 30  # TorchTitan purges in a thread of its own
    while (folder / "step-1").exists() and time.monotonic() < deadline:
        time.sleep(0.2)

    opt = trainer.trainer.optimizers.optimizers[0]
    params = {n: p._local_tensor.clone() for n, p in trainer.state._params.items()}
    exp_avg = [s["exp_avg"]._local_tensor.clone() for s in opt.state.values()]
    lr, tokens = opt.param_groups[0]["lr"], trainer.trainer.ntokens_seen
    with torch.no_grad():  # diverge in every part the checkpoint claims to carry
        for p in trainer.state._params.values():
            p._local_tensor.add_(1.0)
        for s in opt.state.values():
            s["exp_avg"]._local_tensor.zero_()
    opt.param_groups[0]["lr"] = 123.0
    trainer.manager.load_state_dict({"step": 0, "batches_committed": 0})
    trainer.trainer.ntokens_seen = 0
    loaded = trainer.checkpoint.load(4)
    queue.put({
        "healing_fns": healing_fns,
        "saves": saves,
        "refused": refused,
        "dirs": sorted(p.name for p in folder.iterdir()),
        "complete": (folder / "step-4" / ".metadata").is_file(),
        "dump_files": [str(p) for p in dump.rglob("*") if p.is_file()],
        "loaded": loaded,
        "progress": trainer.progress(),
        "model_equal": all(torch.equal(p._local_tensor, params[n]) for n, p in trainer.state._params.items()),
        "exp_avg_equal": all(torch.equal(s["exp_avg"]._local_tensor, e) for s, e in zip(opt.state.values(), exp_avg)),
        "exp_avg_nonzero": any(e.abs().sum() > 0 for e in exp_avg),
        "lr": (lr, opt.param_groups[0]["lr"]),
        "tokens": (tokens, trainer.trainer.ntokens_seen),
    })
    trainer.close()
    lighthouse.shutdown()


def test_torchtitan_checkpoint_saves_and_loads_the_training_state_and_leaves_healing_alone(tmp_path):
    result = in_fresh_interpreter(_save_and_load, tmp_path)
    assert result["healing_fns"] == [STATE_KEY], "the checkpointer must not register state with TorchFT"
    assert [s["step"] for s in result["saves"]] == [1, 2, 3, 4]
    assert all(s["error"] is None and s["blocking_s"] >= 0 for s in result["saves"]), result["saves"]
    assert "cannot save step 3" in result["refused"]["error"]
    # keep=2: TorchTitan's purge keeps the newest two (a third may still be on its way out).
    assert "step-1" not in result["dirs"] and "step-4" in result["dirs"] and len(result["dirs"]) <= 3, result["dirs"]
    assert result["complete"]
    assert result["dump_files"] == [], "nothing is written under the trainer's dump folder"
    assert result["loaded"]["step"] == 4 and result["progress"] == 4
    assert result["model_equal"], "parameters differ after load"
    assert result["exp_avg_nonzero"] and result["exp_avg_equal"], "optimizer state was not saved and loaded"
    assert result["lr"][0] == result["lr"][1] != 123.0
    assert result["tokens"][0] == result["tokens"][1] > 0


def _trainer_on_a_full_disk(tmp: str):
    from pathlib import Path

    from conftest import one_rank_trainer_env

    from monarch_sky.common.checkpoints import CheckpointSpec
    from monarch_sky.config import load_job
    from monarch_sky.recipes import TrainerSpec
    from monarch_sky.replica.trainer import GroupTrainer

    lighthouse = one_rank_trainer_env()
    job = load_job(["replicas=1", "procs_per_replica=1", "steps=100", "faults=none"])
    spec = CheckpointSpec(folder=str(Path(tmp) / "disk" / "checkpoints"), async_mode="async", keep=2)
    return lighthouse, GroupTrainer(TrainerSpec.from_job(job.config, 0, str(Path(tmp) / "dump"), "cpu", checkpoint=spec))


def _reports_of_failed_writes(trainer, wanted: int) -> list:
    reports, deadline = [], time.monotonic() + 60  # the writes run in a thread of their own
    while len(reports) < wanted and time.monotonic() < deadline:
        r = trainer.step()
        if r.write_failed:
            reports.append(list(r.write_failed))
    return reports


def _save_while_the_last_write_is_failing(tmp: str, queue) -> None:
    lighthouse, trainer = _trainer_on_a_full_disk(tmp)
    step = trainer.step().step
    saves = [trainer.save_checkpoint(step)]
    in_flight = not trainer.checkpoint.checkpointer.save_future.done()
    saves.append(trainer.save_checkpoint(step))  # waits for the first write, which fails
    reports = _reports_of_failed_writes(trainer, 2)
    queue.put({"saves": saves, "reports": reports, "in_flight": in_flight})
    trainer.close()
    lighthouse.shutdown()


def _write_to_a_full_disk(tmp: str, queue) -> None:
    lighthouse, trainer = _trainer_on_a_full_disk(tmp)
    saves, reports = [], []
    for _ in range(2):
        saves.append(trainer.save_checkpoint(trainer.step().step))
        deadline = time.monotonic() + 60  # the write runs in a thread of its own
        while time.monotonic() < deadline:
            r = trainer.step()
            if r.write_failed:
                reports.append(list(r.write_failed))
                break
    queue.put({"saves": saves, "reports": reports})
    trainer.close()
    lighthouse.shutdown()


def test_a_background_write_that_fails_is_reported_by_the_next_steps_and_does_not_poison_the_next_save(tmp_path):
    # The checkpoint (~11 MB) goes to a 2 MB disk: staging succeeds, the write fails. The
    # failure must reach the controller within steps, naming that step; before, it showed up
    # only as the next save's error, and TorchTitan re-raised it at every save after.
    with small_disk(tmp_path / "disk"):
        result = in_fresh_interpreter(_write_to_a_full_disk, tmp_path)
    saves, reports = result["saves"], result["reports"]
    assert [s["error"] for s in saves] == [None, None], saves  # staged; the second not poisoned by the first
    assert [step for step, _ in reports] == [s["step"] for s in saves], (reports, saves)
    # ENOSPC, or torch's serializer tripping over the short write first
    assert all(error.startswith("CheckpointException") for _, error in reports), reports


def test_a_save_that_waits_for_a_failing_write_reports_that_write_and_still_saves(tmp_path):
    # TorchTitan's save waits for the write before it and re-raises its failure: DCP's
    # CheckpointException, a BaseException, which aborted the ReplicaActor (the group failed).
    with small_disk(tmp_path / "disk"):
        result = in_fresh_interpreter(_save_while_the_last_write_is_failing, tmp_path)
    saves, reports = result["saves"], result["reports"]
    assert result["in_flight"], "the first write had already ended: this run did not test the wait"
    assert [s["error"] for s in saves] == [None, None], saves
    assert [step for step, _ in reports] == [s["step"] for s in saves], (reports, saves)
    assert all(error.startswith("CheckpointException") for _, error in reports), reports
