"""One replica group's place in the run: a state machine over its generations
(`monarch_sky.control.slot_state`: its states, moves and invariants in one table; `enter` makes each move).

`drive()` runs the group one step per call. When its generation fails (Monarch supervision,
the host agent, the watchdog, or the step call itself said so) the slot recovers on its own:
the broken generation's processes are killed at once (so its TorchFT heartbeats stop and the
survivors stop waiting on it), the generation is discarded or, with a dead host, abandoned and
that host replaced (the group's other hosts are kept), and the warm standby becomes the next
generation, which heals from a peer (`monarch_sky.control.slot_recovery`). Whatever goes wrong in a
recovery costs this slot a restart and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from monarch_sky.common import checkpoints

from monarch_sky.common.supervision import describe_error
from monarch_sky.control import inner_steps, memory_restore, rejoin
from monarch_sky.control.checkpoint_loads import LoadFailure
from monarch_sky.control.context import RunContext
from monarch_sky.control.generations import Generations
from monarch_sky.control.slot_recovery import SlotRecovery
from monarch_sky.control.slot_state import SlotState, check_invariant, check_move, check_thread
from monarch_sky.hosts.base import Host
from monarch_sky.replica.actor import GroupFailed, ReplicaGroup
from monarch_sky.replica.step_result import HealInfo, StepResult


__all__ = ["Slot", "SlotState"]

_KEEP = object()
BUILD_BOUND = 4  # a build's steps (spawn, imports, setup) are each bounded by timeouts.spawn_s


class Slot(SlotRecovery):
    def __init__(self, ctx: RunContext, index: int, hosts: list[Host], host_mesh: Any):
        self.ctx = ctx
        self.index = index
        self.gens = Generations(ctx, index, hosts, host_mesh)
        self.group: ReplicaGroup | None = None  # the generation that trains (attached); set only by `enter`
        self.state = SlotState.STARTING  # set only by `enter`
        self.restarts = 0
        self.step = 0
        self.uncommitted = 0  # steps this slot's groups ran that TorchFT did not commit
        self.data_states: tuple = ()  # per rank: where the group's kept training left its data
        self.skip_steps = 0  # steps of batches trained after `data_states` (rejoin.trained_unreported)
        self.member = ""  # this generation's id in TorchFT's quorum, once it reported one
        self.step_calls = 0  # step calls made to this generation
        self.in_flight_since: float | None = None  # when the step call now running was issued
        self.last_failure: str | None = None  # why the last recovery attempt failed
        self.last_commit_issued = 0.0  # when the last step this slot committed across groups was issued
        self.heal: HealInfo | None = None  # this generation's healing step
        self.loaded_step: int | None = None  # the step this generation loaded (node memory, a checkpoint), until it rejoins
        self.loaded_from: str | None = None  # "memory" or "checkpoint"
        self.state_lost = False  # this generation trained from scratch where a checkpoint could be loaded
        self.started_over = False  # training started over while this slot was down: a heal brings no progress back

    @property
    def hosts(self) -> list[Host]:
        return self.gens.hosts

    @property
    def agent(self):
        return self.gens.agent

    @property
    def active(self) -> bool:
        return self.state in (SlotState.TRAINING, SlotState.DONE)

    def enter(self, state: SlotState, group=_KEEP) -> None:
        """Move to `state` (attaching `group`, or None to detach), as the state table allows."""
        check_thread(self.index, self.ctx.loop_thread)
        check_move(self.index, self.state, state)
        group = self.group if group is _KEEP else group
        check_invariant(self.index, state, group is not None)
        if group is None and self.group is not None:
            self.ctx.checkpoints.loads.forget(self.index)  # what its generation loaded, it holds no more
        self.state, self.group = state, group

    # ---- bring-up ----------------------------------------------------------------

    async def activate(self, rejoining: bool, resume=None) -> bool:
        """Bring up a new generation that trains (loading `resume`, if given: node memory's
        `MemoryPoint` or a checkpoint's `Found`); retries up to ft.max_restarts, on new hosts in
        place of any that died meanwhile. The slot's first generation enters TRAINING (REJOINING
        if it heals from a group that restored the run), a later one REJOINING."""
        while True:
            began = time.monotonic()
            loading, memory = rejoin.what_it_loads(self.ctx, self, rejoining, resume)
            loads = self.ctx.checkpoints.loads
            loads.begin(loading, self.index)
            try:
                data = rejoin.data_handover(self, rejoining, memory)
                group, warm, info = await self.gens.build(rejoining, data, loading, memory.step if memory else None)
            except asyncio.CancelledError:
                loads.abandon(loading, self.index)
                raise
            except Exception as e:  # any failure to start costs this slot a restart, nothing more
                reason = describe_error(e)
                self.ctx.record.event("replica_start_failed", replica=self.index, reason=reason)
                if memory is not None:  # node memory failed it: heal, as a group that has none does
                    self.ctx.record.event("memory_load_failed", replica=self.index, step=memory.step, reason=reason)
                    resume, rejoining = None, True
                    continue
                unreadable = checkpoints.unreadable(str(e))  # (step, why) if a checkpoint load failed it
                verdict = await loads.failed(loading, self.index, unreadable, BUILD_BOUND * self.ctx.cfg.timeouts.spawn_s)
                if verdict is LoadFailure.UNREADABLE:
                    older = await self.ctx.checkpoints.set_aside(loading, unreadable[1])
                    if resume is not None:  # going back live: to the older one, or (none) from scratch
                        resume, rejoining = older, older is None
                    continue  # the checkpoint failed, not the group: no restart spent
                if verdict is LoadFailure.LOADED_ELSEWHERE and resume is not None:
                    resume, rejoining = None, True  # going back live: heal from the group that loaded it
                if not self.may_restart(f"could not start: {reason}"):
                    return False
                self.last_failure = await self.gens.move_off_dead_hosts() or self.last_failure
                continue
            loads.loaded(loading, self.index)
            refused = self.ctx.refuse_platform(info["platform"])
            if refused:  # the host will not change: no restarts
                await self.gens.discard(group)
                self.lose(refused)
                return False
            self.member, self.step_calls, self.heal = "", 0, None
            if resume is not None:  # a live reload (a first generation's restore is the run's: go_on_from)
                rejoin.resume_from(self.ctx, self, resume)
            first = self.state is SlotState.STARTING and not rejoining  # not one healing from a restored group
            self.enter(SlotState.TRAINING if first else SlotState.REJOINING, group)
            self.ctx.note_group_started(self.index, info)
            self.ctx.record.event(
                "replica_started", replica=self.index, generation=group.generation, from_standby=warm,
                hosts=[h.address for h in group.hosts], upstream_ports=info["upstream_ports"],
                seconds=round(time.monotonic() - began, 3), pid=info["pid"], **group.timings,
            )
            return True

    def may_restart(self, reason: str) -> bool:
        if self.ctx.finishing:
            self.lose(self.unfinished())
            return False
        if self.restarts >= self.ctx.cfg.ft.max_restarts:
            self.lose(f"{reason}; gave up after {self.restarts} restarts (ft.max_restarts)")
            return False
        self.restarts += 1
        return True

    def unfinished(self) -> str:
        """Why a slot the run ended without is lost, with what held it up."""
        held_up = f" (last recovery failure: {self.last_failure})" if self.last_failure else ""
        return f"the run finished before it rejoined{held_up}"

    def lose(self, reason: str) -> None:
        self.enter(SlotState.LOST, None)
        self.gens.give_back_hosts()
        self.ctx.lost.append({"replica": self.index, "reason": reason})
        self.ctx.record.event("replica_lost", replica=self.index, reason=reason)
        self.ctx.display.line(f"[replica {self.index}] lost: {reason}; training continues on the others")

    # ---- training ------------------------------------------------------------------

    async def drive(self) -> None:
        while self.state not in (SlotState.DONE, SlotState.LOST):
            if self.ctx.finishing and self.state is SlotState.REJOINING:
                await self.retire(self.unfinished())
                return
            try:
                if self.state is SlotState.REJOINING and self.ctx.cfg.ft.mode == "diloco" and self.loaded_step is None:
                    await self._join_next_sync()
                else:
                    await self._one_step()
                if self.state_lost:
                    self.ctx.display.line(f"[replica {self.index}] trained from scratch, the state being lost: "
                                          "replacing it by a generation that loads the newest state kept")
                    await self.recover("the training state was lost: loading the newest state kept", fault=False)
            except GroupFailed as e:
                await self.recover(describe_error(e))
            except Exception as e:  # a bug or an unexpected answer: this generation is done for
                self.ctx.record.event("replica_error", replica=self.index, error=describe_error(e))
                if self.state in (SlotState.TRAINING, SlotState.REJOINING):  # DONE: it finished all the same
                    self.group.mark_failed(describe_error(e))
                    await self.recover(describe_error(e))
                elif self.state is SlotState.RECOVERING:  # the recovery itself raised: no generation to drive
                    self.lose(f"its recovery failed: {describe_error(e)}")

    async def _one_step(self) -> None:
        ctx, group = self.ctx, self.group
        if (count := inner_steps.batch(ctx, self)) > 1:
            return await inner_steps.run(self, count)
        issued = time.monotonic()
        call = asyncio.ensure_future(group.step(ctx.cfg.timeouts.step_s))
        await asyncio.sleep(0)  # let the step go out before a fault aims at it
        self._fire_faults(group)
        result = await self._timed(call, issued)
        await self.on_result(result, issued)
        await ctx.checkpoints.after_step(self, result)  # the last resort, when due (checkpoint_policy)

    def _fire_faults(self, group: ReplicaGroup) -> None:
        # `faults=` aims at a step, or at a new generation's first step back (`@rejoin`, and
        # `@serve` at the groups it heals from).
        first_back = self.state is SlotState.REJOINING and self.step_calls == 0
        self.step_calls += 1
        injector, ledger = self.ctx.injector, self.ctx.ledger
        injector.fire_due(self.index, ledger.run_step, group, self.kill_host, ledger.step_seconds, rejoining=first_back)
        if first_back:
            training = {s.index: s for s in self.ctx.slots if s.state is SlotState.TRAINING}
            injector.fire_serving(self.index, ledger.run_step, training)
        injector.fire_controller(ledger.run_step, ledger.step_seconds,
                                 memory_restore.after_loss_hint(self.ctx.cfg))

    async def _timed(self, call, issued: float):
        """Await a step call, letting the hang check see how long it has been out."""
        self.in_flight_since = issued
        try:
            return await call
        finally:
            self.in_flight_since = None

    async def _join_next_sync(self) -> None:
        began, began_step = time.monotonic(), self.ctx.ledger.run_step
        if not await rejoin.wait_for_next_sync(self.ctx, self):
            return
        issued = time.monotonic()
        self.ctx.record.event("rejoin_joined_sync", replica=self.index, waited_s=round(issued - began, 3),
                              waited_steps=self.ctx.ledger.run_step - began_step)
        call = asyncio.ensure_future(self.group.join(self.ctx.cfg.timeouts.step_s))
        await asyncio.sleep(0)
        self._fire_faults(self.group)
        await self.on_result(await self._timed(call, issued), issued)

    async def on_result(self, r: StepResult, issued: float, ended: float | None = None) -> None:
        ctx, now = self.ctx, ended or time.monotonic()
        self.step = r.step
        self.uncommitted += not r.committed
        if r.data_states:
            self.data_states, self.skip_steps = r.data_states, 0
            ctx.data_history.add(r)
        self.member = r.member or self.member
        if r.healed_now:
            self.heal = HealInfo.of(r)
        pause_s = max(0.0, r.seconds - ctx.ledger.median_step_s())
        if r.served_bytes:
            ctx.injector.served(r, pause_s)
        if self.state is SlotState.TRAINING:
            ctx.injector.survivor_step(r, issued, pause_s)
        ctx.ledger.add(r, now)
        ctx.memory.after_step(r)
        if self.state is SlotState.REJOINING and not r.committed:
            ctx.record.event("rejoin_step_not_committed", replica=self.index, step=r.step, healed=r.healed)
        for rec in ctx.injector.same_generation_result(r, self.group.generation, issued, now):
            ctx.display.line(f"[replica {self.index}] recovered in place from the {rec.fault.kind}, "
                             f"{rec.seconds(now):.2f}s after it (TorchFT reconfigured, no respawn)")
        if r.synced:
            self.last_commit_issued = issued
            if self.state is SlotState.REJOINING:
                await self._rejoined(r, now)
            ctx.injector.survivor_committed(r, issued, ctx.cfg.replicas, now)
        if r.step >= ctx.cfg.steps:
            self.enter(SlotState.DONE)
            ctx.finishing = True

    async def _rejoined(self, r: StepResult, now: float) -> None:
        behind = rejoin.behind(self.ctx, self, r)
        if behind == rejoin.Behind.CATCHING_UP:  # a commit without the state holders: not a rejoin
            self.ctx.record.event("rejoin_behind", replica=self.index, step=r.step, run_step=self.ctx.ledger.run_step)
            return
        if behind == rejoin.Behind.STATE_LOST:
            if await rejoin.state_to_reload(self.ctx, self) is not None:
                # drive() ends this generation and the next loads it, unless another group comes back to
                self.state_lost = not rejoin.another_coming_back(self.ctx, self)
                return
            rejoin.note_progress_lost(self.ctx, self, r.step)
        self.enter(SlotState.TRAINING)
        source = self.loaded_from or "scratch"
        if r.healed and behind == rejoin.Behind.NO and not self.started_over:
            source = "peer"
        self.loaded_step, self.loaded_from, self.started_over = None, None, False
        heal, self.heal = self.heal or HealInfo(0, 0.0, 0.0), None
        faults = self.ctx.injector.rejoined(self.index, self.group.generation, source, now, heal)
        self.ctx.record.event(
            "replica_rejoined", replica=self.index, generation=self.group.generation, step=r.step, recovered_from=source,
            heal_bytes=heal.nbytes, heal_step_s=heal.step_s, heal_s=heal.transfer_s, heal_gb_per_s=heal.gb_per_s,
            heal_sources=dict(heal.sources), heal_transport=heal.path or self.ctx.heal_transport,
        )
        after = "".join(f", {rec.seconds(now):.2f}s after the {rec.fault.kind}" for rec in faults)
        rate = f" at {heal.gb_per_s:.2f} GB/s" if heal.gb_per_s else ""
        carried = f", {heal.nbytes / 1e6:.1f} MB{rate} in a {heal.step_s:.2f}s step" if heal.nbytes else ""
        self.ctx.display.line(f"[replica {self.index}] rejoined at step {r.step}{after} (weights from {source}{carried})")
        self.gens.refill_standby()

    def kill_host(self, host: Host) -> None:
        self.ctx.in_background(self.ctx.provider_call(self.ctx.provider.kill, host, what=f"killing host {host.name}"))

    # ---- end of run ----------------------------------------------------

    async def final_state(self) -> dict[str, Any]:
        return await self.group.final_state(self.ctx.cfg.timeouts.stop_s)
