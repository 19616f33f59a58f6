"""DiLoCo's half of a rank's trainer: joining a sync without training, and what a rejoin sends.

A DiLoCo group restarted after a fault heals inside the next sync, not at a step: `join` runs
the sync with no inner steps, and `_contribute_nothing` keeps the healed group from counting its
source twice in the outer average. `_align_schedule` keeps the LR schedule on committed progress
after a failed sync rolled the inner steps back. `GroupTrainer` (`trainer.py`) mixes this in.
"""

from __future__ import annotations

import time

from monarch_sky.replica import heal_transport
from monarch_sky.replica.step_result import StepResult


class DiLoCoJoin:
    def _contribute_nothing(self, _state: dict) -> None:
        """DiLoCo: a healing group heals inside the sync, before its pseudo-gradient (original
        minus current parameters) is computed. Having just received the peer's current
        parameters, it would send that peer's pseudo-gradient a second time and count the peer
        twice in the outer average. Resetting its parameters to the healed originals makes its
        pseudo-gradient zero: it adds nothing to this one sync. Every heal, not only a restarted
        group's: a group that missed a sync (its commit refused while its peers committed) heals
        at the next one the same way (its weights end equal either way: the outer step applies
        to the healed originals).
        """
        for fragment in self._fragments:
            fragment.restore_parameters()

    def join(self) -> StepResult:
        """DiLoCo: take part in the next sync without training first.

        Steps the optimizer through one sync interval with no gradients (AdamW skips
        parameters without one), so DiLoCo's hooks run the sync: the quorum heals this group
        from a peer. No data is read and no inner step runs on the fresh weights. The
        controller calls this when the other groups are about to sync.
        """
        trainer, start = self.trainer, time.perf_counter()
        self._decision = None
        trainer.optimizers.zero_grad()
        self._before_update()
        for _ in range(self._sync_steps):
            trainer.optimizers.step()
            self._version += 1
            if self._decision is not None:
                break
        self._joined = self._joined or bool(self._decision)
        self._inner_steps = 0
        self._align_schedule()
        self._after_update(bool(self._decision))
        healed_now, self._healed_now = self._healed_now, False
        member, quorum, healing = self._quorum.take()
        if healing:
            self._agree_after_heal()
        return StepResult(
            replica=self.spec.replica,
            step=self.progress(),
            committed=bool(self._decision),
            synced=bool(self._decision),
            loss=None,
            tokens=0,
            participants=self.manager.num_participants(),
            healed=self._healed,
            healed_now=healed_now,
            heal_bytes=self._take_heal_bytes(),
            seconds=time.perf_counter() - start,
            data_states=(self._data.kept,),
            member=member,
            quorum=quorum if self._rank == 0 else (),
            **heal_transport.step_stats(self.transport),
            **self._memory_stats(),
        )

    def inner_steps(self, count: int) -> list[StepResult]:
        """DiLoCo: up to `count` steps in one call, none of them a sync: the controller asks
        for the inner steps before the next sync this way when nothing is aimed at them, one
        call instead of one per step. Stops after a step that did not commit."""
        results = [self.step()]
        while len(results) < count and results[-1].committed and not results[-1].synced:
            results.append(self.step())
        return results

    def _align_schedule(self) -> None:
        """Keep the LR schedule a function of committed progress.

        Needed after a failed DiLoCo sync, which rolls the weights back over the inner
        steps since the last sync (torchtitan's scheduler would have kept them).
        """
        schedulers = self.trainer.lr_schedulers
        progress = self.progress()
        if schedulers.schedulers[0].last_epoch == progress:
            return
        schedulers.load_state_dict({"last_epoch": progress})
        for scheduler in schedulers.schedulers:
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
