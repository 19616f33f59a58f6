"""One rank's load of the released weights a run starts from: TorchTitan's own HF safetensors
path (`checkpoint.initial_load_path` with `initial_load_in_hf`), model only.

The trainer's built-in checkpointer stays off (trainer_checkpoint.py says why), so a
checkpointer of its own is made for this one load, pointed at a folder that never exists, which
makes TorchTitan take its initial-load branch. Each rank reads its own FSDP shards.
"""

from __future__ import annotations

import os
import time

from monarch_sky.replica.digest import shard_digest

NO_CHECKPOINTS = "monarch-sky-initial-load-only"  # a folder name never written


def load_if_starting(trainer, config, spec) -> dict | None:
    """Load the run's released weights when this group starts the run's state (not restored
    from node memory or a checkpoint, and not joining past a commit: the controller then leaves
    `spec.init_weights` unset); what `load` says, or None."""
    resumed = spec.checkpoint is not None and spec.checkpoint.resume_step is not None
    if not spec.init_weights or spec.restore_step is not None or resumed:
        return None
    return load(trainer, config, spec.init_weights)


def load(trainer, config, path: str) -> dict:
    """Load `path`'s weights into this rank's shards; the seconds it took and the shards' digest."""
    from torchtitan.components.checkpoint import CheckpointManager

    adapter = config.model_spec.state_dict_adapter(config.model_spec.model, config.hf_assets_path)
    checkpointer = CheckpointManager(
        CheckpointManager.Config(
            enable=True, folder=NO_CHECKPOINTS, async_mode="disabled", keep_latest_k=0,
            initial_load_path=path, initial_load_in_hf=True, initial_load_model_only=True,
        ),
        dataloader=None, model_parts=trainer.model_parts, optimizers=trainer.optimizers,
        lr_schedulers=trainer.lr_schedulers, states={}, sd_adapter=adapter,
        base_folder=os.path.join(config.dump_folder, "initial-load"),
    )
    start = time.perf_counter()
    if not checkpointer.load():
        raise FileNotFoundError(f"init.weights_path: TorchTitan found no weights to load in {path}")
    return {"path": path, "seconds": round(time.perf_counter() - start, 3), "digest": shard_digest(trainer.model_parts)}
