"""The benchmark's step record for the arms that run TorchTitan's own loop (`titan_arm`).

Group rank 0 appends one JSON line per iteration to `steps.jsonl`, as monarch-sky's run
record does for its arms: wall, replica, step, committed, seconds, loss, participants.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class StepLog:
    """Wraps the trainer's per-step calls and writes each iteration's line.

    Iteration: from `train_step` to the end of the `checkpointer.save` after it, so saving
    counts. Loss: the step's forward losses summed over the group's loss mesh, as TorchTitan
    logs it (its own per-step logging is off in the recipe). Committed: what TorchFT's
    `should_commit` returned to its optimizer wrapper. A step that healed the group has no loss:
    its forward ran on the weights the heal replaced (monarch-sky's DiLoCo join reports none).

    DiLoCo (`diloco`): an inner step stands only if the next sync commits, so its line waits
    for that sync and takes its decision. Steps a group trained before a heal replaced its
    weights never stood. A failed sync rolls the weights back over its interval (TorchFT's
    DiLoCo) and TorchTitan's counter is moved back with them, so those steps are trained
    again, as monarch-sky counts progress; the LR schedule is left as TorchTitan steps it.
    """

    def __init__(self, trainer, path: Path, replica: int, record: bool, replicas: int, diloco: bool = False):
        import torch

        self.trainer, self.replica, self.replicas, self.diloco = trainer, replica, replicas, diloco
        self.file = open(path, "a", buffering=1) if record else None
        ft = getattr(trainer, "ft_manager", None)
        self.manager = ft.manager if ft is not None and ft.enabled else None
        mesh = trainer.parallel_dims.get_optional_mesh("loss")
        self.loss_group = mesh.get_group() if mesh is not None else None
        self.loss = torch.zeros((), device=trainer.device)
        self.start, self.decision, self.healed = 0.0, True, False
        self.pending: list[dict] = []  # DiLoCo: this interval's lines, until its sync decides
        self._wrap(trainer)

    def _wrap(self, trainer) -> None:
        fwd_bwd, train_step, save = trainer.forward_backward_step, trainer.train_step, trainer.checkpointer.save

        def forward_backward_step(**kwargs):
            loss = fwd_bwd(**kwargs)
            self.loss += loss.detach()
            return loss

        def step(data_iterator):
            self.start, before = time.perf_counter(), trainer.step
            self.decision = None if self.diloco else self.manager is None
            self.loss.zero_()
            train_step(data_iterator)
            self.healed = trainer.step != before
            if self.healed:  # TorchFT loaded a peer's train state
                print(f"[titan_arm] replica {self.replica}: healed from a peer, step {before} -> {trainer.step}",
                      flush=True)

        def checkpoint_save(curr_step, last_step=False):
            saved = save(curr_step, last_step=last_step)
            self._record(curr_step)
            return saved

        trainer.forward_backward_step, trainer.train_step = forward_backward_step, step
        trainer.checkpointer.save = checkpoint_save
        if self.manager is not None:
            decide = self.manager.should_commit

            def should_commit(*args, **kwargs) -> bool:
                self.decision = decide(*args, **kwargs)
                return self.decision

            self.manager.should_commit = should_commit

    def _record(self, step: int) -> None:
        import torch

        if self.loss_group is not None:
            torch.distributed.all_reduce(self.loss, group=self.loss_group)
        participants = self.manager.num_participants() if self.manager is not None else self.replicas
        line = {"wall": time.time(), "replica": self.replica, "step": int(step), "committed": bool(self.decision),
                "seconds": time.perf_counter() - self.start, "loss": None if self.healed else float(self.loss.item()),
                "participants": participants}
        if not self.diloco:
            self._write([line])
        elif self.decision is None:
            self.pending.append(line)
        else:
            stood = bool(self.decision) and not self.healed
            interval = [{**p, "committed": stood} for p in self.pending] + [line]
            self.pending = []
            self._write(interval)
            if not self.decision and not self.healed:  # a healed counter is the peer's
                self.trainer.step -= len(interval)

    def _write(self, lines: list[dict]) -> None:
        if self.file is None:
            return
        self.file.write("".join(json.dumps(line) + "\n" for line in lines))
        self.file.flush()
