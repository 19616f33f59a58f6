"""A DiLoCo group healed inside a sync adds nothing to that sync's outer average.

Runs a real TorchTitan trainer in DiLoCo mode (one process, one replica group, a real
lighthouse) in a fresh interpreter, because the CPU shims must apply before torchtitan is
first imported.
"""

from __future__ import annotations

from conftest import in_fresh_interpreter


def _heal_in_place(tmp: str, queue) -> None:
    import torch
    from conftest import one_rank_trainer_env
    from torchft.local_sgd import extract_local_tensor

    from monarch_sky.config import load_job
    from monarch_sky.recipes import TrainerSpec
    from monarch_sky.replica.trainer import REJOIN_KEY, GroupTrainer

    lighthouse = one_rank_trainer_env()
    job = load_job(["replicas=1", "procs_per_replica=1", "steps=20", "faults=none", "ft.mode=diloco",
                    "ft.sync_steps=5"])
    trainer = GroupTrainer(TrainerSpec.from_job(job.config, 0, tmp, "cpu"))
    for _ in range(7):  # a sync at 5, then two inner steps: the parameters left the originals
        trainer.step()
    fragments = trainer._fragments
    def at_originals():  # torchft keeps each fragment's originals by parameter name
        return [torch.equal(extract_local_tensor(p.data), f.original_parameters[n])
                for f in fragments for n, p in f._model_fragment.named_parameters()]

    moved = not all(at_originals())
    # What a heal at the next sync calls last, after the peer's state was loaded: this group
    # was never restarted (it missed a sync in place), so `_rejoining` is False.
    assert not trainer._rejoining
    trainer.manager._load_state_dict_fns[REJOIN_KEY]({})
    reset = all(at_originals())
    queue.put({"moved": moved, "reset": reset, "fragments": len(fragments)})
    trainer.close()
    lighthouse.shutdown()


def test_a_group_healed_in_a_sync_without_a_restart_contributes_a_zero_pseudo_gradient(tmp_path):
    # A group whose commit was refused while its peers committed heals at the next sync without
    # a restart; its parameters must go back to the healed originals (a zero pseudo-gradient),
    # or it sends its source's pseudo-gradient again and the outer average counts that peer twice.
    result = in_fresh_interpreter(_heal_in_place, tmp_path)
    assert result["fragments"] > 0 and result["moved"], f"test premise: inner steps moved the weights: {result}"
    assert result["reset"], "a heal in place left inner-trained weights where the originals belong"
