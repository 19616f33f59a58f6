"""What a restarted controller goes on from: the run's newest checkpoint, if it is this run's.

A controller that restarts a run (same `run_id`) finds what the dead one left: its run record
(`tracking.previous_attempt`) or, on a new machine, only the checkpoint folder on a bucket
(`attempt_from_checkpoint`), with the scheduled faults fired so far (`fired_before`). It
resumes from the newest complete checkpoint whose note says it was saved by this run under
the same shape and settings (`resume_from`), or refuses, naming the fields.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from omegaconf import OmegaConf

from monarch_sky.common import checkpoints
from monarch_sky.common.checkpoints import Found


# What a checkpoint's weights and data position only make sense with: the run's shape, and the
# settings that shape its schedule and batches. A resume under other values would mix two runs.
SHAPE = ("recipe", "replicas", "procs_per_replica", "hosts_per_replica")
SETTINGS = ("steps", "seed", "training.seq_len", "training.local_batch_size", "training.lr",
            "training.warmup_steps", "data.dataset", "ft.mode", "ft.sync_steps")


class CheckpointMismatch(ValueError):
    """The run's checkpoint was saved by another run or under other settings."""


def fingerprint(cfg) -> dict[str, Any]:
    """The values a checkpoint's note records for `resume_from` to compare."""
    return {key: OmegaConf.select(cfg, key) for key in (*SHAPE, *SETTINGS)}


def refuse_other_settings(cfg, saved: dict[str, Any], what: str, kept: str) -> None:
    """Raises CheckpointMismatch, naming the fields, if `saved` (a `fingerprint`) differs from
    this run's; `what` was saved under it, `kept` says what becomes of it."""
    wanted = fingerprint(cfg)
    differ = [k for k in wanted if k in saved and saved[k] != wanted[k]]
    if differ:
        raise CheckpointMismatch(
            f"{what} was saved with " + ", ".join(f"{k}={saved[k]}" for k in differ)
            + "; this run asks " + ", ".join(f"{k}={wanted[k]}" for k in differ)
            + f". Run again with the saved values to go on from it, or pick a new run_id to start afresh ({kept})"
        )


def resume_from(cfg, previous: dict[str, Any]) -> Found | None:
    """At a controller restart: the run's newest complete checkpoint.

    Says what was found in `previous` (the `controller_restarted` event and the summary).
    Raises CheckpointMismatch, naming the fields, when the checkpoint is another run's or was
    saved under other settings: the run must not start over on top of it (TorchTitan's purge
    would delete each new, lower-numbered save) nor load it.
    """
    folder = checkpoints.folder_for(cfg)
    found = checkpoints.newest(folder)
    previous["resumed_from_step"] = None
    if found is None:
        return None
    owner = found.note.get("run_id", cfg.run_id)
    if owner != cfg.run_id:
        raise CheckpointMismatch(
            f"the checkpoint at step {found.step} in {folder} belongs to run {owner}, not {cfg.run_id}: "
            "give this run its own checkpoint.folder, or move that folder away"
        )
    saved = {**found.note.get("settings", {}), **{k: found.note[k] for k in SHAPE if k in found.note}}
    saved.setdefault("hosts_per_replica", 1)  # notes older than groups spanning hosts
    refuse_other_settings(cfg, saved, f"run {cfg.run_id}'s checkpoint at step {found.step} ({found.path})",
                          "the checkpoint is kept either way")
    previous["resumed_from_step"] = found.step
    previous["steps_lost"] = max(0, previous["last_step"] - found.step)
    previous["discarded_checkpoints"] = checkpoints.discard_newer(folder, found.step)
    return found


def data_states(found: Found, index: int) -> tuple:
    """Group `index`'s data position (per rank) at the checkpoint's step."""
    return tuple(found.note.get("data_states", {}).get(str(index), ()))


def attempt_from_checkpoint(cfg) -> dict[str, Any] | None:
    """A run with no record here but a checkpoint (or a fired fault) in its folder (on a
    bucket): its controller moved to a new machine (a new pod), whose disk never held the
    run's record."""
    if cfg.checkpoint.every_min <= 0:
        return None
    folder = checkpoints.folder_for(cfg)
    found, fired = checkpoints.newest(folder), checkpoints.faults_fired(folder)
    if found is None and not fired:
        return None
    return {"last_step": found.step if found else 0, "faults_injected": 0,
            "ended": "its record is not on this machine", "faults_fired": fired}


def fired_before(cfg, previous: dict[str, Any]) -> list[str]:
    """Every scheduled fault an earlier controller of the run fired: the run record's list and
    the checkpoint folder's (each spec as often as the longer says: controllers on two pods)."""
    from_record = previous.get("faults_fired", [])
    if cfg.checkpoint.every_min <= 0:
        return from_record
    both = Counter(from_record) | Counter(checkpoints.faults_fired(checkpoints.folder_for(cfg)))
    return list(both.elements())


def restart_message(run_id: str, previous: dict[str, Any]) -> str:
    last = previous["last_step"]
    said = (
        f"monarch-sky: run {run_id} lost its previous controller ({previous['ended']}) at step {last} "
        f"(last recorded); reaped {previous['reaped_processes']} processes it left behind. "
    )
    step = previous.get("resumed_from_step")
    if step is not None:
        return said + (
            f"Resumed from the checkpoint at step {step}; lost {previous['steps_lost']} steps "
            f"(the last recorded step was {last})."
        )
    return said + ("There is no checkpoint: the run goes on from the newest state its hosts hold in node memory, "
                   "if any, else from step 0.")
