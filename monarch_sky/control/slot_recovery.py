"""What a slot does when its generation fails: note who saw it first, end the broken
generation (discard it, or abandon it and fence its dead hosts), get hosts in place of the
dead ones, wait for the survivors' commit and bring up the next generation, which heals
from a peer or loads a checkpoint. A mixin of `monarch_sky.control.slot.Slot`, whose state it moves."""

from __future__ import annotations

import time

from monarch_sky.common.supervision import describe_error
from monarch_sky.control import rejoin
from monarch_sky.control.detection import kill_on_hosts
from monarch_sky.control.slot_state import SlotState, check_thread
from monarch_sky.hosts.base import Host
from monarch_sky.replica.actor import ReplicaGroup


class SlotRecovery:
    def on_failure(self, group: ReplicaGroup, reason: str, at: float) -> None:
        """Any detector's word that `group` broke; the first one counts."""
        check_thread(self.index, self.ctx.loop_thread)
        if group is not self.group:  # a standby died: the next recovery spawns cold
            if group.failure is None:
                group.mark_failed(reason)
                self.ctx.record.event("standby_failed", replica=self.index, generation=group.generation, reason=reason)
            return
        if group.detected:
            return
        group.mark_failed(reason)  # wakes the step call waiting on this group
        group.detected = True
        self.ctx.last_failure_at = max(self.ctx.last_failure_at, at)
        self._note_detection(group.failure, at)
        if self.agent is not None and group.pids:
            # Its live ranks would keep heartbeating to the lighthouse: end them now.
            kill_on_hosts(self.agent, group.pids)

    def _note_detection(self, reason: str, at: float) -> None:
        faults = self.ctx.injector.detected(self.index, at)
        if not faults:
            self.ctx.unplanned.append({"replica": self.index, "step": self.step, "reason": reason})
        self.ctx.record.event(
            "failure_detected", replica=self.index, generation=self.group.generation, reason=reason, planned=bool(faults)
        )
        tag = "".join(f", {r.seconds(at):.2f}s after the {r.fault.kind}" for r in faults) or " (UNPLANNED)"
        self.ctx.display.line(f"[replica {self.index}] failed{tag}: {reason}")

    async def recover(self, reason: str, fault: bool = True) -> None:
        """Replace the slot's generation: it failed (`fault`), or it trained from scratch
        after the state was lost, where a checkpoint could be loaded (no restart spent)."""
        group = self.group
        if fault:
            self.on_failure(group, reason, time.monotonic())  # the step call may have been first
        else:
            group.mark_failed(reason)
            group.detected = True  # its processes' exits are not news
        self.enter(SlotState.RECOVERING, None)
        self.loaded_step, self.loaded_from, self.state_lost = None, None, False
        lost = await self._end_generation(group)
        if fault and not self.may_restart(reason):
            return
        while True:
            try:
                await self._come_back(lost)
                return
            except Exception as e:  # never let one slot's recovery end the run
                self.last_failure = describe_error(e)
                self.ctx.record.event("recovery_error", replica=self.index, error=describe_error(e))
                self.ctx.display.line(f"[replica {self.index}] recovery failed: {describe_error(e)}")
                if not self.may_restart(describe_error(e)):
                    return
                lost = await self.gens.lost_hosts()

    async def _end_generation(self, group: ReplicaGroup) -> list[Host]:
        """Stop the broken generation; returns the group's hosts that are dead."""
        lost = await self.gens.lost_hosts()
        if not lost:
            began = time.monotonic()
            await self.gens.discard(group)
            self.ctx.record.event("replica_stopped", replica=self.index, generation=group.generation,
                                  seconds=round(time.monotonic() - began, 3))
            return lost
        self.gens.abandon(group)
        await self.gens.fence_lost(lost)
        return lost

    async def _come_back(self, lost: list[Host]) -> None:
        if lost:  # raises HostError (a restart of this slot) if no host comes
            await self.gens.replace_hosts(lost)
        await rejoin.wait_for_survivors_commit(self.ctx, self)
        # Spent once asked: a second failure before the next generation's first answer adds nothing.
        member, self.member = self.member, ""
        self.skip_steps += rejoin.trained_unreported(self.ctx, self, member)
        found = await rejoin.state_to_reload(self.ctx, self)
        if not await self.activate(rejoining=found is None, resume=found):
            return
        if self.ctx.finishing:
            await self.retire(self.unfinished())
            return
        what = "its hosts' node memory" if self.loaded_from == "memory" else "the checkpoint"
        loaded = f", loaded {what} at step {self.loaded_step}" if self.loaded_step is not None else ""
        self.ctx.display.line(f"[replica {self.index}] respawned as generation {self.group.generation}{loaded}, rejoining")

    async def retire(self, reason: str) -> None:
        group = self.group
        self.lose(reason)
        if group is not None:
            self.gens.forget(group)
            await group.close(self.ctx.cfg.timeouts.stop_s)
