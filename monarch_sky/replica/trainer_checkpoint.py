"""One rank's side of the last-resort checkpoint: TorchTitan's own asynchronous checkpointer.

Peer healing covers every failure that leaves a replica group alive; this is for the rest
(the controller's node lost, every group lost at once). It is built only when the run has
checkpoints on, or resumes from one, and it never touches healing:

- It is TorchTitan's `CheckpointManager` (DCP, `async` or `async_with_pinned_mem`), built
  here over the trainer's model parts, optimizers, LR schedulers and dataloader, and never
  given the TorchFT manager. TorchTitan's `TorchFTCheckpointManager`, which the trainer
  builds when `checkpoint.enable` is set, would register the full `model.state_dict()` as
  TorchFT's healing state (replacing the rank-local state of `monarch_sky.replica.healing`) and
  write a dataloader checkpoint every step.
- Saving runs on the training thread between steps, when the controller asks one group
  (see `monarch_sky.control.checkpoint_policy`); the step loop waits only for the staging copy
  (and, before the next optimizer step, for a pinned-memory stage still in flight).
- Loading happens once, when a restarted controller resumes a run and the group is not
  rejoining: a group that rejoins a running job always heals from a peer instead.
- The step saved is TorchFT's committed step (`manager.state_dict()`; DiLoCo: syncs, and
  saves happen only at syncs); a checkpoint folder is named for the run's step. The data position comes from the controller (the dataloader is saved by
  TorchTitan but never loaded: each group reads its own shard, and only one group saves).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from torch.distributed.checkpoint.api import CheckpointException

from monarch_sky.common import test_hooks
from monarch_sky.common.checkpoints import UNREADABLE, CheckpointSpec
from monarch_sky.common.supervision import short_reason


# DCP's CheckpointException derives from BaseException: `except Exception` misses it, and
# one escaping an endpoint aborts the ReplicaActor.
CHECKPOINT_ERRORS = (Exception, CheckpointException)


class CheckpointUnreadable(RuntimeError):
    """A complete checkpoint that this rank could not load (corrupt, truncated, a bad mount)."""


class CommittedProgress:
    """The run's position as TorchFT counts it (a DCP `Stateful`): committed steps, not
    torchtitan's step counter, which also advances on steps TorchFT did not commit."""

    def __init__(self, trainer, manager, progress: Callable[[], int]):
        self._trainer = trainer
        self._manager = manager
        self._progress = progress  # the run's committed steps (DiLoCo: syncs x sync_steps + inner)

    def state_dict(self) -> dict[str, Any]:
        return {**self._manager.state_dict(), "ntokens_seen": self._trainer.ntokens_seen, "progress": self._progress()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._manager.load_state_dict({"step": state["step"], "batches_committed": state["batches_committed"]})
        self._trainer.ntokens_seen = state["ntokens_seen"]
        self._trainer.step = state["step"]


class TrainerCheckpoint:
    def __init__(self, trainer, manager, spec: CheckpointSpec, progress: Callable[[], int]):
        from torchtitan.components.checkpoint import DATALOADER, TRAIN_STATE, CheckpointManager

        config = CheckpointManager.Config(
            enable=True,
            folder=spec.folder,  # absolute: every group and the controller name the same place
            interval=1,  # the controller decides when; every save() it asks for is written
            keep_latest_k=spec.keep,
            async_mode=spec.async_mode,
            exclude_from_loading=[DATALOADER],
            initial_load_model_only=False,
        )
        self._writing_step: int | None = None  # the step of the last background write asked for
        self._write_failures: list[tuple] = []  # (step, error) of background writes that failed, not yet reported
        self._optimizers = trainer.optimizers
        self._progress = CommittedProgress(trainer, manager, progress)
        self.checkpointer = CheckpointManager(
            config,
            dataloader=trainer.dataloader,
            model_parts=trainer.model_parts,
            optimizers=trainer.optimizers,
            lr_schedulers=trainer.lr_schedulers,
            states={TRAIN_STATE: self._progress},
            sd_adapter=None,
        )

    def _refresh_optimizer_view(self) -> None:
        # TorchTitan's TorchFT optimizer container answers state_dict() from a cache that
        # only TorchFTCheckpointManager fills (an empty dict otherwise): fill it now.
        self._optimizers.init_cache_state_dict()

    def load(self, step: int, fail: bool = False) -> dict[str, Any]:
        """Load the checkpoint at `step` into this rank; returns what was loaded. Any failure
        raises CheckpointUnreadable: the controller then sets it aside and tries an older one,
        unless another group loaded it (`fail`: a failure on purpose, for tests)."""
        began = time.perf_counter()
        try:
            if fail:
                raise OSError(f"this load fails on purpose ({test_hooks.FAIL_A_LOAD_ENV})")
            self._refresh_optimizer_view()
            if not self.checkpointer.load(step=step):
                raise FileNotFoundError(f"no checkpoint at step {step} in {self.checkpointer.folder}")
            loaded = self._progress.state_dict()["progress"]
            if loaded != step:
                raise ValueError(f"the checkpoint in step-{step} holds step {loaded}")
        except CHECKPOINT_ERRORS as e:
            # One line the controller reads the step from (DCP's own message is a traceback per rank).
            raise CheckpointUnreadable(f"{UNREADABLE.format(step=step)}: {type(e).__name__}: {short_reason(str(e))}") from e
        return {"step": loaded, "load_s": round(time.perf_counter() - began, 3)}

    def save(self, step: int) -> dict[str, Any]:
        """Stage this rank's state for step `step`; the write goes on in the background.

        Never raises: a failed save (a full disk, an earlier upload that failed) is
        reported to the controller, and the group trains on.
        """
        began = time.perf_counter()
        error = None
        self._finish_write()
        try:
            self._refresh_optimizer_view()
            self.checkpointer.save(step)
            self._writing_step = step
        except CHECKPOINT_ERRORS as e:  # a checkpoint never fails a training group
            error = f"{type(e).__name__}: {short_reason(str(e))}"[:300]
        return {"step": step, "blocking_s": time.perf_counter() - began, "error": error}

    def _finish_write(self) -> None:
        """Wait for the last background write, as TorchTitan's save would, but note its failure
        for the controller instead of letting TorchTitan re-raise it into this save."""
        future = self.checkpointer.save_future
        if future is not None and not future.cancelled():
            future.exception()  # blocks until the write ends; returns its error, never raises it
        self._check_write()

    def _check_write(self) -> None:
        """Note the last background write's failure once it has finished failing."""
        future = self.checkpointer.save_future
        if future is None or not future.done() or future.cancelled() or future.exception() is None:
            return
        error = future.exception()
        # Cleared: TorchTitan keeps a failed write's future and re-raises it at every later save.
        self.checkpointer.save_future = None
        self._write_failures.append((self._writing_step, f"{type(error).__name__}: {short_reason(str(error))}"))

    def take_write_failure(self) -> tuple:
        """(step, error) of the oldest background write failure not yet reported, or (): one
        per step, so two failures between steps are both reported."""
        self._check_write()
        return self._write_failures.pop(0) if self._write_failures else ()

    def before_update(self) -> None:
        """Wait for a pinned-memory stage still copying the parameters the optimizer is
        about to change (TorchTitan's trainer does the same before its optimizer step)."""
        self.checkpointer.maybe_wait_for_staging()

    def close(self) -> None:
        """Let the last write finish (the controller bounds this call), then stop. A write
        that failed here has no later step to report it: it goes to this rank's log."""
        try:
            self._finish_write()
            for step, error in self._write_failures:
                print(f"WARNING: the checkpoint write of step {step} failed: {error}", flush=True)
        finally:
            self.checkpointer.close()


def save(checkpoint: TrainerCheckpoint | None, step: int, progress: int) -> dict[str, Any]:
    """What a save request from the controller gets: the save, or why there was none."""
    if checkpoint is None or step != progress:
        why = "no checkpointer (checkpoint.every_min=0)" if checkpoint is None else f"the trainer is at step {progress}"
        return {"step": step, "blocking_s": 0.0, "error": f"cannot save step {step}: {why}"}
    return checkpoint.save(step)


def attach(
    trainer, manager, spec: CheckpointSpec | None, rejoining: bool, progress: Callable[[], int], replica: int
) -> tuple[TrainerCheckpoint | None, dict | None]:
    """This rank's checkpointer (None when the run has none) and, when the run resumes and
    this group is not rejoining, the checkpoint loaded and this rank's data position."""
    if spec is None:
        return None, None
    checkpoint = TrainerCheckpoint(trainer, manager, spec, progress)
    if spec.resume_step is None or rejoining:
        return checkpoint, None
    checkpoint.load(spec.resume_step, fail=test_hooks.fail_a_load(replica))
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return checkpoint, (spec.resume_data[rank] if rank < len(spec.resume_data) else None)
