"""The single Monarch controller: starts the lighthouse and the hosts, runs the slots, ends.

One `Slot` per replica group drives its training one step per call and recovers its
group on its own (see `monarch_sky.control.slot`); TorchFT keeps the groups in step. The
controller starts everything, routes every failure signal to the slot it concerns
(Monarch supervision, the host agents, the host watchdog), collects the final states and
shuts everything down, however the run ends. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

from monarch_sky.common import platform as platform_mod
from monarch_sky.common import supervision
from monarch_sky.config import Job, ranks_per_group
from monarch_sky.control import heal_budget
from monarch_sky.control.checkpoint_policy import CheckpointPolicy
from monarch_sky.control.context import RunContext, off_loop
from monarch_sky.control.failure_watch import FailureWatch
from monarch_sky.control.host_replacement import attach_hosts
from monarch_sky.control.ledger import DataHistory, StatusCounts, StepLedger
from monarch_sky.control.memory_restore import NodeMemory, Superseded, go_on_from, restarted_without_memory
from monarch_sky.control.shutdown import stop_everything
from monarch_sky.control.slot import Slot
from monarch_sky.control.slot_state import SlotState
from monarch_sky.control.spares import SparePool
from monarch_sky.control.summary import build_summary
from monarch_sky.faults.injector import FaultInjector
from monarch_sky.hosts import lighthouse_gate, tls
from monarch_sky.hosts.base import HostProvider
from monarch_sky.record.progress import Display
from monarch_sky.record.tracking import RunRecord, Tracker

log = logging.getLogger(__name__)



class Controller:
    def __init__(
        self,
        job: Job,
        provider: HostProvider,
        record: RunRecord,
        tracker: Tracker,
        display: Display,
        previous_controller: dict[str, Any] | None = None,  # what a dead controller of this run left
        resume=None,  # checkpoints.Found: the checkpoint a restarted run goes on from
        survey_memory: bool = False,  # the run id may be an existing run's: ask the hosts' node memory
    ):
        cfg = job.config
        self.ctx = ctx = RunContext(cfg, provider, record, tracker, display, platform_mod.detect())
        ctx.checkpoints = CheckpointPolicy(ctx, resume, previous_controller)
        ctx.memory = NodeMemory(ctx)
        ctx.memory.fired = list((previous_controller or {}).get("faults_fired", []))  # noted again with each new one
        ctx.injector = FaultInjector(job.faults, cfg.seed, ranks_per_group(cfg), record, display, tracker,
                                     fired_before=(previous_controller or {}).get("faults_fired", []),
                                     on_fired=self._note_fault_fired)
        ctx.ledger = StepLedger(cfg.steps, record, tracker, display, self._counts)
        ctx.data_history = DataHistory()
        self.survey_memory = survey_memory
        self.agents: list[asyncio.Future] = []  # each slot's host agent, starting
        self.keep_memory = False  # the run failed: its node memory stays for a run again under its id
        ctx.spares = SparePool(ctx)
        self.slots: list[Slot] = ctx.slots
        self.lighthouse = None
        self.gate = None  # lighthouse_gate's relay in front of it, when the run has TLS
        self.previous_controller = previous_controller
        self.left_running: list[str] = []  # the run's processes its orderly stop missed (shutdown.py)

    async def run(self) -> dict[str, Any]:
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        ctx.loop_thread = threading.get_ident()
        self._budget_heals()
        try:
            self._start_lighthouse()
            ctx.router = supervision.FailureRouter(
                lambda owner, report: loop.call_soon_threadsafe(self._on_failure, owner, report, time.monotonic())
            )
            await self._start_hosts()
            if self.survey_memory:
                await self._go_on_from_memory()
            if ctx.memory.restored is None and self.previous_controller is not None:
                ctx.memory.restored = restarted_without_memory(ctx, self.previous_controller)
            ctx.phase(f"starting {len(self.slots)} replica groups (process spawn + imports + trainer build)")
            started = await asyncio.gather(*(s.activate(rejoining=self._heals_first(s)) for s in self.slots))
            if not any(started):
                raise RuntimeError("no replica group could start; see replica_start_failed in events.jsonl")
            await self._warm_standbys()
            ctx.checkpoints.start_training()
            ctx.phase(f"training {ctx.cfg.steps} steps")
            ctx.record.event("training_started", replicas=len(self.slots))
            ctx.in_background(FailureWatch(ctx).run())
            if ctx.cfg.chaos.every_s > 0:
                ctx.in_background(ctx.injector.chaos(ctx.cfg.chaos, ctx.cfg.replicas, ctx.cfg.steps, self._training,
                                                     lambda: ctx.ledger.run_step, self._time_left_s, self._recovering))
            await self._drive_all()
            ctx.ledger.flush(final=True)
            final, errors = await self._final_states()
            summary = build_summary(ctx, self.slots, final, errors, self.previous_controller)
        except Exception:
            self.keep_memory = True  # a controller's failure: a run again under its id goes on from memory
            raise
        finally:
            fenced = ctx.memory.fenced_by is not None  # the hosts and their memory are the newer controller's
            self.left_running = await stop_everything(ctx, self.slots, self.lighthouse,
                                                      forget_memory=not (self.keep_memory or fenced), release_hosts=not fenced)
            if self.gate is not None:
                self.gate.close()
        summary["left_running"] = self.left_running
        summary["clusters_left_up"] = self.ctx.provider.left_up()
        return summary

    def partial_summary(self, outcome: dict[str, Any]) -> dict[str, Any]:
        """The summary of a run that was stopped or failed before its end."""
        summary = build_summary(self.ctx, self.slots, {}, {}, self.previous_controller)
        summary["outcome"] = outcome
        summary["left_running"] = self.left_running
        summary["clusters_left_up"] = self.ctx.provider.left_up()
        return summary

    def _note_fault_fired(self, spec: str):
        self.ctx.checkpoints.note_fault_fired(spec)
        return self.ctx.memory.note_fault_fired(spec)

    async def _go_on_from_memory(self) -> None:
        """A run id that may be an existing run's: go on from the newest state its hosts hold."""
        ctx = self.ctx
        agents = await asyncio.wait_for(asyncio.gather(*self.agents), ctx.cfg.timeouts.spawn_s)
        point = await ctx.memory.survey(agents)
        if ctx.memory.fenced_by is not None:
            raise Superseded(f"another controller of run {ctx.cfg.run_id} (epoch {ctx.memory.fenced_by}) claimed "
                             "its hosts first")
        resume = ctx.checkpoints.resume
        if point is None or (resume is not None and resume.step > point.step):
            return
        ctx.checkpoints.drop_resume()  # node memory holds a newer state than the checkpoint
        ctx.memory.point = point
        ctx.memory.restored = go_on_from(ctx, point, self.previous_controller)

    def _heals_first(self, slot: Slot) -> bool:
        """Going on from node memory, a group whose hosts hold none of it heals from one that does."""
        point = self.ctx.memory.point
        return point is not None and slot.index not in point.loaders

    def _time_left_s(self) -> float:
        """The rest of the run at the recent pace."""
        return (self.ctx.cfg.steps - self.ctx.ledger.run_step) * self.ctx.ledger.median_step_s()

    def _training(self) -> list[Slot]:
        return [s for s in self.slots if s.state is SlotState.TRAINING]

    def _recovering(self) -> list[Slot]:
        """Slots whose next generation has not begun its first step back (its heal)."""
        return [s for s in self.slots if s.state is SlotState.RECOVERING
                or (s.state is SlotState.REJOINING and s.step_calls == 0)]

    def _counts(self) -> StatusCounts:
        injector = self.ctx.injector
        training = sum(s.active for s in self.slots)
        return StatusCounts(len(self.slots), training, len(injector.records), injector.recovered())

    def _budget_heals(self) -> None:
        """Timeouts a heal of this model needs (heal_budget): GPU rates off this machine."""
        ctx = self.ctx
        kind = ctx.platform.kind if ctx.cfg.hosts.provider == "local" else "rocm"
        budget = heal_budget.apply(ctx.cfg, kind)
        ctx.heal_transport = budget["transport"]
        ctx.record.event("heal_budget", **budget)

    def _start_lighthouse(self) -> None:
        from torchft.coordination import LighthouseServer

        ft, ip = self.ctx.cfg.ft, self.ctx.provider.controller_ip()
        gated = lighthouse_gate.enabled()  # with a run certificate: only its holders reach the lighthouse
        self.lighthouse = LighthouseServer(
            bind=f"{'127.0.0.1' if gated else socket.gethostbyname(ip)}:0",  # never every interface
            min_replicas=ft.min_replicas,
            join_timeout_ms=ft.join_timeout_ms,
            quorum_tick_ms=ft.quorum_tick_ms,
            heartbeat_timeout_ms=ft.heartbeat_timeout_ms,
        )
        port = int(self.lighthouse.address().rsplit(":", 1)[1])
        if gated:
            self.gate = lighthouse_gate.gate(socket.gethostbyname(ip), port)
            port = self.gate.port
        self.ctx.lighthouse_address, self.ctx.lighthouse_gated = f"http://{ip}:{port}", gated
        self.ctx.record.event("lighthouse_started", address=self.ctx.lighthouse_address, gated=gated)

    async def _start_hosts(self) -> None:
        from monarch.actor import enable_transport

        ctx = self.ctx
        per = ctx.cfg.hosts_per_replica
        count = ctx.cfg.replicas * per
        ctx.phase(f"starting {count} hosts ({type(ctx.provider).__name__})")
        hosts = await asyncio.wait_for(off_loop(ctx.provider.start, count), ctx.cfg.hosts.provision_timeout_s)
        enable_transport(f"{tls.scheme()}://{ctx.provider.controller_ip()}:0")  # workers dial back here
        for index in range(ctx.cfg.replicas):
            group_hosts = hosts[index * per:(index + 1) * per]
            self.slots.append(Slot(ctx, index, group_hosts, await attach_hosts(ctx, group_hosts)))
        self.agents = [ctx.in_background(slot.gens.start_agent()) for slot in self.slots]
        ctx.record.event("hosts_ready", hosts=[h.address for h in hosts])

    async def _warm_standbys(self) -> None:
        """A standby process set per group, warmed while the groups train, so a recovery skips
        the imports (a fault before one is ready waits for the rest of its warm-up). Spare hosts
        are waited for: a run asks for them to take a lost host at once."""
        ctx = self.ctx
        if ctx.cfg.ft.standby:
            ctx.phase("warming a standby process set per group in the background, so recovery skips the imports")
        for slot in self.slots:
            slot.gens.refill_standby()
        if ctx.spares.size:
            ctx.phase(f"warming {ctx.spares.size} spare host(s)")
            spares = ctx.in_background(ctx.spares.start())
            if ctx.memory.restored is None:
                await asyncio.wait([spares], timeout=ctx.cfg.timeouts.spawn_s)

    async def _drive_all(self) -> None:
        """Every slot trains on its own; one slot's trouble never cancels another's.

        Once a group reaches the target, a slot still recovering stops at once (its group
        could not rejoin anyway) and a slot with a step out gets `timeouts.stop_s` to finish
        it, so the run ends promptly even while a provider call or a step hangs.
        """
        ctx = self.ctx
        tasks = {asyncio.ensure_future(s.drive()): s for s in self.slots}
        pending = set(tasks)
        try:
            while pending and not ctx.finishing:
                _, pending = await asyncio.wait(pending, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if ctx.memory.fenced_by is not None:
                    raise Superseded(f"a newer controller of run {ctx.cfg.run_id} (epoch {ctx.memory.fenced_by}) "
                                     "drives it now")
            for task in pending:  # a step call already out (a rejoiner's last sync too) may finish
                if tasks[task].state is not SlotState.TRAINING and tasks[task].in_flight_since is None:
                    task.cancel()
            if pending:
                _, pending = await asyncio.wait(pending, timeout=ctx.cfg.timeouts.stop_s)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=ctx.cfg.timeouts.stop_s)  # their cleanup is bounded
        for task, slot in tasks.items():
            if task.done():
                self._settle(slot, task)

    def _settle(self, slot: Slot, task: asyncio.Task) -> None:
        """Say why a slot that did not finish the run ended."""
        error = None
        if not task.cancelled() and task.exception() is not None:
            error = f"{type(task.exception()).__name__}: {task.exception()}"
            self.ctx.record.event("replica_error", replica=slot.index, error=error)
        if slot.state in (SlotState.DONE, SlotState.LOST):
            return
        if error is not None:
            slot.lose(f"controller error: {error}")
        elif slot.state is SlotState.TRAINING:
            slot.lose(f"did not finish its last step within timeouts.stop_s={self.ctx.cfg.timeouts.stop_s:g}s")
        else:
            slot.lose(slot.unfinished())

    # ---- failure detection -----------------------------------------------------------

    def _on_failure(self, owner: str, report: str, at: float) -> None:
        group = self.ctx.groups.get(owner)
        if group is not None and group.index < 0:  # a spare's warm process set: the pool drops it
            group.mark_failed(supervision.short_reason(report))
        elif group is not None:
            self.slots[group.index].on_failure(group, supervision.short_reason(report), at)

    # ---- end of run ------------------------------------------------------------------

    async def _final_states(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        done = [s for s in self.slots if s.state is SlotState.DONE]
        results = await asyncio.gather(*(s.final_state() for s in done), return_exceptions=True)
        final, errors = {}, {}
        for slot, result in zip(done, results):
            if isinstance(result, BaseException):
                errors[str(slot.index)] = f"{type(result).__name__}: {result}"[:300]
                self.ctx.record.event("final_state_failed", replica=slot.index, reason=errors[str(slot.index)])
            else:
                final[str(slot.index)] = result
        return final, errors
