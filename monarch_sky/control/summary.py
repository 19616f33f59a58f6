"""The run's summary (`summary.json`): what was committed, what failed, how it ended."""

from __future__ import annotations

import os
import time
from typing import Any

from monarch_sky.common import checkpoints, released_weights
from monarch_sky.control.context import RunContext
from monarch_sky.record.outcome import judge


def build_summary(
    ctx: RunContext,
    slots: list,
    final: dict[str, dict[str, Any]],
    final_errors: dict[str, str],
    previous_controller: dict[str, Any] | None,
) -> dict[str, Any]:
    cfg = ctx.cfg
    summary = {
        "run_id": ctx.record.path.name,
        "recipe": cfg.recipe,
        "replicas": cfg.replicas,
        "procs_per_replica": cfg.procs_per_replica,
        "hosts_per_replica": cfg.hosts_per_replica,
        "ft_mode": cfg.ft.mode,
        "heal_transport": ctx.heal_transport,
        "platform": ctx.replica_platform or ctx.platform.kind,  # the trainers' hosts, e.g. "rocm x8"
        "cross_group": ctx.cross_group,  # how groups reached each other: RDMA, TCP sockets, gloo over TCP
        "target_steps": cfg.steps,
        "committed_steps": ctx.ledger.run_step,
        "initial_weights": {"source": released_weights.source(cfg.init), "loads": ctx.initial_loads},
        "checkpoints_written": checkpoints_written(ctx),
        "loss": ctx.ledger.first_and_last_loss(),
        "wall_s": round(time.monotonic() - ctx.start_time, 3),
        "between_steps": ctx.ledger.between_steps(),  # the controller's turn between a group's steps
        "final_param_digest": {k: v["digest"] for k, v in final.items()},
        "final_lr": {k: v["lr"] for k, v in final.items()},
        "scheduler_steps": {k: v["scheduler_steps"] for k, v in final.items()},
        "final_state_errors": final_errors,
        "uncommitted_steps": {str(s.index): s.uncommitted for s in slots},
        "faults": [r.to_summary() for r in ctx.injector.records],
        "faults_not_fired": [str(f) for f in ctx.injector.pending],  # e.g. a @rejoin fault with no rejoin after it
        "unplanned_failures": ctx.unplanned,
        "lost_replicas": ctx.lost,
        "progress_lost": ctx.progress_lost,
        "restarts": {str(s.index): s.restarts for s in slots},
        "spares": ctx.spares.summary() if ctx.spares is not None else None,
        "previous_controller": previous_controller,
        "controller_lost": ctx.memory.summary() if ctx.memory is not None else None,
        "node_memory": ctx.memory.cost() if ctx.memory is not None else None,
        "checkpoint": ctx.checkpoints.summary() if ctx.checkpoints is not None else None,
        "tracking_error": ctx.tracker.error,
        "wandb": {"mode": ctx.tracker.mode, "location": ctx.tracker.location},  # offline: `wandb sync` that folder
    }
    summary["outcome"] = judge(summary)
    return summary


def checkpoints_written(ctx: RunContext) -> int:
    """Every checkpoint file of the run: in the last-resort folder (`checkpoint.every_min`)
    and anything a torchtitan checkpointer wrote under a replica's dump folder."""
    dumped = sum(len(checkpoint_files(ctx.dump_folder(i))) for i in range(ctx.cfg.replicas))
    return dumped + len(checkpoints.files(checkpoints.folder_for(ctx.cfg)))


def checkpoint_files(dump_folder: str) -> list[str]:
    """Files any torchtitan checkpointer wrote under this replica's dump folder."""
    root = os.path.join(dump_folder, "checkpoint")
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]
