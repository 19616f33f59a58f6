"""The single Monarch controller: starts the lighthouse, runs the replica groups, heals.

One asyncio task per replica group drives its training one step per call. TorchFT keeps
the groups in step; the controller only watches. When Monarch reports a group's process
dead (or a call raises, or a step hangs past its timeout), that task stops the broken
process mesh and spawns a new generation of the group on the same host; the new group's
first TorchFT quorum heals it live from a healthy peer. The other tasks never wait for
it. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from monarch_sky import platform as platform_mod
from monarch_sky import supervision
from monarch_sky.config import Job
from monarch_sky.faults import PROCESS_KINDS, Fault
from monarch_sky.hosts import Host, HostError, HostProvider
from monarch_sky.progress import Display
from monarch_sky.recipes import TrainerSpec
from monarch_sky.replica import GroupFailed, ReplicaGroup
from monarch_sky.trainer import checkpoint_files
from monarch_sky.tracking import RunRecord, Tracker

log = logging.getLogger(__name__)


@dataclass
class FaultRecord:
    fault: Fault
    rank: int | None  # None: the whole host
    injected_at: float  # time.monotonic()
    detected_at: float | None = None
    resumed_at: float | None = None  # a survivor committed a step begun after injection
    rejoined_at: float | None = None  # the respawned group committed a step
    recovered_from: str | None = None  # "peer": weights came live from another group
    steps_while_down: set[int] = field(default_factory=set)  # committed without the group

    def seconds(self, at: float | None) -> float | None:
        return None if at is None else round(at - self.injected_at, 3)

    def to_summary(self) -> dict[str, Any]:
        return {
            "kind": self.fault.kind,
            "replica": self.fault.replica,
            "step": self.fault.step,
            "rank": self.rank,
            "detected_s": self.seconds(self.detected_at),
            "survivors_resumed_s": self.seconds(self.resumed_at),
            "rejoined_s": self.seconds(self.rejoined_at),
            "recovered_from": self.recovered_from,
            "steps_while_down": len(self.steps_while_down),
        }


@dataclass
class Slot:
    """One replica group's place in the run, across its generations."""

    index: int
    host: Host
    host_mesh: Any
    group: ReplicaGroup | None = None  # the generation that trains
    standby: asyncio.Task | None = None  # resolves to a warmed next generation
    generations: int = 0  # generations spawned so far (standbys included)
    restarts: int = 0
    state: str = "starting"  # starting | training | rejoining | recovering | done | lost
    step: int = 0
    uncommitted: int = 0  # steps this slot's groups ran that TorchFT did not commit
    open_faults: list[FaultRecord] = field(default_factory=list)  # not yet rejoined


@dataclass
class StepStats:
    first_seen: float
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    quorum: int = 0
    replicas: set[int] = field(default_factory=set)


class Controller:
    def __init__(
        self,
        job: Job,
        provider: HostProvider,
        record: RunRecord,
        tracker: Tracker,
        display: Display,
        previous_controller: dict[str, Any] | None = None,  # what a dead controller of this run left
    ):
        self.job = job
        self.cfg = job.config
        self.provider = provider
        self.record = record
        self.tracker = tracker
        self.display = display
        self.platform = platform_mod.detect()
        self.target = self.cfg.steps
        self.slots: list[Slot] = []
        self.pending_faults = list(job.faults)
        self.fault_records: list[FaultRecord] = []
        self.unplanned: list[dict[str, Any]] = []
        self.lost: list[dict[str, Any]] = []
        self.steps: dict[int, StepStats] = {}
        self.run_step = 0
        self.logged_step = 0
        self.finishing = False
        self.rng = random.Random(self.cfg.seed)
        self.step_seconds = 1.0  # moving average, used to land faults mid-step
        self.lighthouse = None
        self.lighthouse_address = ""
        self.router: supervision.FailureRouter | None = None
        self.groups: dict[str, ReplicaGroup] = {}  # every live generation, standbys too
        self.background: set[asyncio.Task] = set()
        self.start_time = time.monotonic()
        self.previous_controller = previous_controller

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        try:
            self._start_lighthouse()
            self.router = supervision.FailureRouter(
                lambda owner, report: loop.call_soon_threadsafe(
                    self._on_failure, owner, report, time.monotonic()
                )
            )
            await self._start_hosts()
            self._phase(f"starting {len(self.slots)} replica groups (process spawn + imports + trainer build)")
            await _all_or_nothing(self._activate(slot) for slot in self.slots)
            if self.cfg.ft.standby:
                self._phase("warming a standby process set per group, so recovery skips the imports")
                for slot in self.slots:
                    self._refill_standby(slot)
                await asyncio.wait([s.standby for s in self.slots if s.standby is not None])
            self._phase(f"training {self.target} steps")
            self.record.event("training_started", replicas=len(self.slots))
            watchdog = asyncio.ensure_future(self._watch_hosts())
            self.background.add(watchdog)
            await _all_or_nothing(self._drive(slot) for slot in self.slots)
            watchdog.cancel()
            self._flush_steps(final=True)
            return self._summary(await self._final_states())
        finally:
            await self._shutdown()

    def _phase(self, text: str) -> None:
        self.display.line(f"[{time.monotonic() - self.start_time:6.1f}s] {text}")

    def _start_lighthouse(self) -> None:
        from torchft.coordination import LighthouseServer

        ft = self.cfg.ft
        self.lighthouse = LighthouseServer(
            bind="0.0.0.0:0",
            min_replicas=ft.min_replicas,
            join_timeout_ms=ft.join_timeout_ms,
            quorum_tick_ms=ft.quorum_tick_ms,
            heartbeat_timeout_ms=ft.heartbeat_timeout_ms,
        )
        port = self.lighthouse.address().rsplit(":", 1)[1]
        self.lighthouse_address = f"http://{self.provider.controller_ip()}:{port}"
        self.record.event("lighthouse_started", address=self.lighthouse_address)

    async def _start_hosts(self) -> None:
        from monarch.actor import enable_transport

        self._phase(f"starting {self.cfg.replicas} hosts ({type(self.provider).__name__})")
        hosts = await asyncio.to_thread(self.provider.start, self.cfg.replicas)
        enable_transport(f"tcp://{self.provider.controller_ip()}:0")
        for index, host in enumerate(hosts):
            self.slots.append(Slot(index=index, host=host, host_mesh=await self._attach(host)))
        self.record.event("hosts_ready", hosts=[h.address for h in hosts])

    async def _attach(self, host: Host):
        """Each host is its own HostMesh: a dead host never blocks the others' meshes."""
        from monarch.actor import attach_to_workers

        mesh = attach_to_workers(name=f"host-{host.name}", ca="trust_all_connections", workers=[host.address])
        await asyncio.wait_for(_await(mesh.initialized), self.cfg.timeouts.spawn_s)
        return mesh

    # ---- generations: spawn (warm standby) -> setup (training) -> discard ------------------

    async def _spawn(self, slot: Slot) -> ReplicaGroup:
        """A new generation of the slot's group with processes up and code imported."""
        group = ReplicaGroup(slot.index, slot.generations, slot.host, slot.host_mesh, self.cfg.procs_per_replica)
        slot.generations += 1
        self.groups[group.owner] = group
        self.router.watch(group.owner)
        try:
            await group.spawn(self._spec(slot.index), self._proc_env(slot.host), self.cfg.timeouts.spawn_s)
        except BaseException:
            await self._discard(group)
            raise
        return group

    def _forget(self, group: ReplicaGroup) -> None:
        """No more failures, shutdown or standby duty for this generation."""
        self.router.unwatch(group.owner)
        self.groups.pop(group.owner, None)

    async def _discard(self, group: ReplicaGroup) -> None:
        self._forget(group)
        await group.stop(self.cfg.timeouts.stop_s)

    def _abandon(self, group: ReplicaGroup) -> None:
        """Forget a group on a dead host: stopping a mesh there would hang."""
        self._forget(group)
        group.proc_mesh = None

    def _abandon_standby(self, slot: Slot) -> None:
        """The standby shared the dead host: drop it without waiting on that host."""
        task, slot.standby = slot.standby, None
        if task is None:
            return
        if task.done() and not task.cancelled() and task.exception() is None:
            self._abandon(task.result())
        else:
            task.cancel()  # its cleanup waits on the dead host, bounded by timeouts.stop_s
            self.background.add(task)

    def _refill_standby(self, slot: Slot) -> None:
        if self.cfg.ft.standby and not self.finishing and slot.standby is None:
            slot.standby = asyncio.ensure_future(self._spawn(slot))

    async def _take_standby(self, slot: Slot) -> tuple[ReplicaGroup, bool]:
        """The warm standby if it is alive, else a freshly spawned generation."""
        task, slot.standby = slot.standby, None
        if task is not None:
            try:
                group = await task
            except GroupFailed:
                group = None
            if group is not None and group.failure is None:
                return group, True
            if group is not None:
                await self._discard(group)
        return await self._spawn(slot), False

    async def _activate(self, slot: Slot) -> bool:
        """Bring up a new generation that trains; retries up to ft.max_restarts."""
        while True:
            began = time.monotonic()
            group = None
            try:
                group, warm = await self._take_standby(slot)
                info = await group.setup(self.cfg.timeouts.spawn_s)
            except GroupFailed as e:
                if group is not None:
                    await self._discard(group)
                self.record.event("replica_start_failed", replica=slot.index, reason=str(e))
                if not self._may_restart(slot, f"could not start: {short_reason(str(e))}"):
                    return False
                continue
            slot.group = group
            self.record.event(
                "replica_started",
                replica=slot.index,
                generation=group.generation,
                from_standby=warm,
                seconds=round(time.monotonic() - began, 3),
                pid=info["pid"],
                **group.timings,
            )
            return True

    def _may_restart(self, slot: Slot, reason: str) -> bool:
        if self.finishing:
            self._lose(slot, "the run finished before it could rejoin")
            return False
        if slot.restarts >= self.cfg.ft.max_restarts:
            self._lose(slot, f"{reason}; gave up after {slot.restarts} restarts (ft.max_restarts)")
            return False
        slot.restarts += 1
        return True

    def _lose(self, slot: Slot, reason: str) -> None:
        slot.state = "lost"
        slot.group = None
        self.lost.append({"replica": slot.index, "reason": reason})
        self.record.event("replica_lost", replica=slot.index, reason=reason)
        self.display.line(f"[replica {slot.index}] lost: {reason}; training continues on the others")

    # ---- training ------------------------------------------------------------------

    async def _drive(self, slot: Slot) -> None:
        if slot.group is None:
            return
        slot.state = "training"
        while slot.state not in ("done", "lost"):
            if self.finishing and slot.state == "rejoining":
                await self._retire(slot, "the run finished before it rejoined")
                return
            group = slot.group
            issued = time.monotonic()
            call = asyncio.ensure_future(group.step(self.cfg.timeouts.step_s))
            await asyncio.sleep(0)  # let the step go out before a fault aims at it
            self._maybe_inject(slot, group)
            try:
                result = await call
            except GroupFailed as e:
                await self._recover(slot, short_reason(str(e)))
                continue
            self._on_result(slot, result, issued)

    def _maybe_inject(self, slot: Slot, group: ReplicaGroup) -> None:
        for fault in list(self.pending_faults):
            if fault.replica != slot.index or self.run_step < fault.step:
                continue
            self.pending_faults.remove(fault)
            delay = 0.5 * self.step_seconds  # land inside the step, as real failures do
            if fault.kind in PROCESS_KINDS:
                rank = self.rng.randrange(self.cfg.procs_per_replica)
                group.inject(fault.kind, rank, delay)
                target = f"replica {slot.index} rank {rank}"
            else:
                rank = None
                asyncio.get_running_loop().call_later(delay, self._kill_host, slot.host)
                target = f"replica {slot.index}'s host {slot.host.name}"
            rec = FaultRecord(fault, rank, injected_at=time.monotonic() + delay)
            self.fault_records.append(rec)
            slot.open_faults.append(rec)
            self.record.event("fault_injected", kind=fault.kind, replica=slot.index, rank=rank, step=self.run_step)
            self.display.line(f"[fault] {fault.kind} -> {target} at step {self.run_step}")

    def _kill_host(self, host: Host) -> None:
        task = asyncio.ensure_future(asyncio.to_thread(self.provider.kill, host))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _on_result(self, slot: Slot, r: dict[str, Any], issued: float) -> None:
        now = time.monotonic()
        slot.step = r["step"]
        slot.uncommitted += not r["committed"]
        self.step_seconds = 0.8 * self.step_seconds + 0.2 * r["seconds"]
        if r["synced"]:
            if slot.state == "rejoining":
                self._rejoined(slot, r, now)
            for rec in self.fault_records:
                if rec.fault.replica == slot.index or issued < rec.injected_at or rec.rejoined_at:
                    continue
                if r["participants"] < self.cfg.replicas:
                    rec.steps_while_down.add(r["step"])
                if rec.resumed_at is None:
                    rec.resumed_at = now
                    self.record.event("survivors_resumed", replica=rec.fault.replica, seconds=rec.seconds(now))
        if r["committed"]:
            stats = self.steps.setdefault(r["step"], StepStats(first_seen=now))
            stats.losses.append(r["loss"])
            stats.tokens += r["tokens"]
            stats.quorum = max(stats.quorum, r["participants"])
            stats.replicas.add(slot.index)
            self.run_step = max(self.run_step, r["step"])
            self._flush_steps()
        if r["step"] >= self.target:
            slot.state = "done"
            self.finishing = True

    def _rejoined(self, slot: Slot, r: dict[str, Any], now: float) -> None:
        slot.state = "training"
        source = "peer" if r["healed"] else "scratch"
        faults, slot.open_faults = slot.open_faults, []
        for rec in faults:
            rec.rejoined_at, rec.recovered_from = now, source
            self.tracker.note({"fault/rejoined_s": rec.seconds(now)})
        self.record.event("replica_rejoined", replica=slot.index, generation=slot.group.generation, step=r["step"], recovered_from=source)
        after = ", ".join(f"{rec.seconds(now):.2f}s after the {rec.fault.kind}" for rec in faults)
        self.display.line(f"[replica {slot.index}] rejoined at step {r['step']}{', ' + after if after else ''} (weights from {source})")
        self._refill_standby(slot)

    def _flush_steps(self, final: bool = False) -> None:
        """Log each step once the run has moved past it (or at the end)."""
        last = self.run_step if final else self.run_step - 1
        for step in range(self.logged_step + 1, last + 1):
            stats = self.steps.get(step)
            if stats is None:
                continue
            prev = self.steps.get(step - 1)
            elapsed = stats.first_seen - (prev.first_seen if prev else self.start_time)
            tps = stats.tokens / elapsed if elapsed > 0 else 0.0
            loss = sum(stats.losses) / len(stats.losses)
            self.tracker.log(
                {
                    "loss": loss,
                    "tokens_per_s": tps,
                    "quorum_size": stats.quorum,
                    "participating_replicas": len(stats.replicas),
                },
                step=step,
            )
            if step % max(1, self.target // 20) == 0:
                self.record.event("progress", step=step, loss=round(loss, 4))
            self.display.status(
                step, loss, tps, stats.quorum, len(self.slots),
                sum(s.state in ("training", "done") for s in self.slots),
                len(self.fault_records), sum(r.rejoined_at is not None for r in self.fault_records),
            )
        self.logged_step = max(self.logged_step, last)

    # ---- failures ------------------------------------------------------------------

    async def _watch_hosts(self, every_s: float = 1.0) -> None:
        """Notice a dead host in about a second: Monarch takes several to give up on it.

        A probe is a TCP connect to the host's worker; the kernel answers it however busy the
        worker is, so a refused or timed-out connect means the host (or its worker) is gone.
        """
        while True:
            await asyncio.sleep(every_s)
            watched = [s for s in self.slots if s.group is not None and s.group.failure is None]
            alive = await asyncio.gather(*(asyncio.to_thread(self.provider.alive, s.host, every_s) for s in watched))
            for slot, ok in zip(watched, alive):
                group = slot.group
                if not ok and group is not None and group.failure is None:
                    self._on_failure(group.owner, f"host {slot.host.name} ({slot.host.address}) is unreachable", time.monotonic())

    def _on_failure(self, owner: str, report: str, at: float) -> None:
        group = self.groups.get(owner)
        if group is None or group.failure is not None:
            return
        group.mark_failed(short_reason(report))
        slot = self.slots[group.index]
        if slot.group is group:
            group.detected = True
            self._note_detection(slot, group.failure, at)
        else:  # a standby died: the next recovery spawns cold
            self.record.event("standby_failed", replica=group.index, generation=group.generation, reason=group.failure)

    def _note_detection(self, slot: Slot, reason: str, at: float) -> None:
        undetected = [r for r in slot.open_faults if r.detected_at is None]
        for rec in undetected:
            rec.detected_at = at
            self.tracker.note({"fault/detected_s": rec.seconds(at)})
        if not undetected:
            self.unplanned.append({"replica": slot.index, "step": slot.step, "reason": reason})
        self.record.event("failure_detected", replica=slot.index, generation=slot.group.generation, reason=reason, planned=bool(undetected))
        when = "".join(f", {r.seconds(at):.2f}s after the {r.fault.kind}" for r in undetected)
        tag = when if undetected else " (UNPLANNED)"
        self.display.line(f"[replica {slot.index}] failed{tag}: {reason}")

    async def _recover(self, slot: Slot, reason: str) -> None:
        group = slot.group
        if not group.detected:  # the call failed before Monarch supervision said so
            group.detected = True
            self._note_detection(slot, reason, time.monotonic())
        slot.state = "recovering"
        slot.group = None
        host_alive = await asyncio.to_thread(self.provider.alive, slot.host)
        if host_alive:
            began = time.monotonic()
            await self._discard(group)
            self.record.event("replica_stopped", replica=slot.index, generation=group.generation, seconds=round(time.monotonic() - began, 3))
        else:
            self._abandon(group)
            self._abandon_standby(slot)
        if not self._may_restart(slot, reason):
            return
        if not host_alive and not await self._replace_host(slot):
            return
        if not await self._activate(slot):
            return
        if self.finishing:
            await self._retire(slot, "the run finished before it rejoined")
            return
        slot.state = "rejoining"
        self.display.line(f"[replica {slot.index}] respawned as generation {slot.group.generation}, rejoining")

    async def _replace_host(self, slot: Slot) -> bool:
        lost = slot.host
        self.record.event("host_lost", replica=slot.index, host=lost.address)
        self.display.line(f"[replica {slot.index}] host {lost.name} ({lost.address}) is gone; asking for a replacement")
        began = time.monotonic()
        try:
            host = await asyncio.wait_for(
                asyncio.to_thread(self.provider.replace, lost), self.cfg.hosts.provision_timeout_s
            )
            mesh = await self._attach(host)
        except (HostError, asyncio.TimeoutError, OSError) as e:
            reason = str(e) or f"no replacement host within {self.cfg.hosts.provision_timeout_s:.0f}s"
            self.record.event("host_replacement_failed", replica=slot.index, reason=reason)
            self._lose(slot, f"host {lost.name} was lost and no replacement came: {reason}")
            return False
        slot.host, slot.host_mesh = host, mesh
        seconds = round(time.monotonic() - began, 3)
        self.record.event("host_replaced", replica=slot.index, host=host.address, seconds=seconds)
        self.display.line(f"[replica {slot.index}] replacement host {host.name} ({host.address}) attached after {seconds:.1f}s")
        return True

    async def _retire(self, slot: Slot, reason: str) -> None:
        group = slot.group
        self._lose(slot, reason)
        if group is not None:
            self._forget(group)
            await group.close(self.cfg.timeouts.stop_s)

    # ---- end of run ------------------------------------------------------------------

    async def _final_states(self) -> dict[str, dict[str, Any]]:
        done = [s for s in self.slots if s.state == "done"]
        results = await asyncio.gather(
            *(s.group.final_state(self.cfg.timeouts.step_s) for s in done), return_exceptions=True
        )
        return {str(s.index): r for s, r in zip(done, results) if isinstance(r, dict)}

    def _summary(self, final: dict[str, dict[str, Any]]) -> dict[str, Any]:
        first = self.steps.get(min(self.steps)) if self.steps else None
        last = self.steps.get(max(self.steps)) if self.steps else None
        return {
            "run_id": self.record.path.name,
            "recipe": self.cfg.recipe,
            "replicas": self.cfg.replicas,
            "procs_per_replica": self.cfg.procs_per_replica,
            "ft_mode": self.cfg.ft.mode,
            "platform": self.platform.kind,
            "target_steps": self.target,
            "committed_steps": self.run_step,
            "checkpoints_written": self._checkpoints_written(),
            "loss": {
                "first": _mean(first.losses) if first else None,
                "last": _mean(last.losses) if last else None,
            },
            "wall_s": round(time.monotonic() - self.start_time, 3),
            "final_param_digest": {k: v["digest"] for k, v in final.items()},
            "final_lr": {k: v["lr"] for k, v in final.items()},
            "scheduler_steps": {k: v["scheduler_steps"] for k, v in final.items()},
            "uncommitted_steps": {str(s.index): s.uncommitted for s in self.slots},
            "faults": [r.to_summary() for r in self.fault_records],
            "unplanned_failures": self.unplanned,
            "lost_replicas": self.lost,
            "restarts": {str(s.index): s.restarts for s in self.slots},
            "previous_controller": self.previous_controller,
        }

    def _checkpoints_written(self) -> int:
        return sum(len(checkpoint_files(self._dump_folder(i))) for i in range(self.cfg.replicas))

    async def _shutdown(self) -> None:
        for slot in self.slots:
            if slot.standby is not None:
                slot.standby.cancel()
        standbys = [s.standby for s in self.slots if s.standby is not None]
        for task in self.background:
            task.cancel()
        await asyncio.gather(*standbys, *self.background, return_exceptions=True)
        await asyncio.gather(
            *(g.close(self.cfg.timeouts.stop_s) for g in list(self.groups.values())),
            return_exceptions=True,
        )
        await asyncio.gather(*(self._release_host(s) for s in self.slots), return_exceptions=True)
        if self.router is not None:
            self.router.uninstall()
        await asyncio.to_thread(self.provider.shutdown)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()

    async def _release_host(self, slot: Slot) -> None:
        """Tell a live host's worker the run is over (bootstrapped nodes then exit)."""
        if await asyncio.to_thread(self.provider.alive, slot.host):
            await asyncio.wait_for(_await(slot.host_mesh.shutdown()), self.cfg.timeouts.stop_s)

    # ---- helpers ------------------------------------------------------------------

    def _dump_folder(self, index: int) -> str:
        return str(self.record.path / "torchtitan" / f"replica_{index}")

    def _spec(self, index: int) -> TrainerSpec:
        return TrainerSpec.from_job(self.cfg, index, self._dump_folder(index), self.platform.kind)

    def _proc_env(self, host: Host) -> dict[str, str]:
        env = {
            "TORCHFT_LIGHTHOUSE": self.lighthouse_address,
            platform_mod.ADVERTISE_ENV: host.ip,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
            "PYTHONUNBUFFERED": "1",
        }
        if self.platform.is_cpu:
            env.update(platform_mod.cpu_thread_env())
        return env


async def _await(future):
    return await future


async def _all_or_nothing(coros) -> None:
    """Run coroutines together; the first one to raise cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def short_reason(report: str) -> str:
    """One line a user can act on, from a Monarch supervision report or an error."""
    text = str(report)
    marker = "the process this actor was running on failed:"
    if marker in text:
        return "process died: " + text.rsplit(marker, 1)[1].strip().splitlines()[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "unknown failure"
    if any(line.startswith("Traceback") for line in lines):
        return lines[-1][:300]  # the exception itself
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {lines[1]}"
    if "> has status:" in first:  # "... actor <root>.<...> has status: <status>"
        return "actor " + first.rsplit("> has status:", 1)[1].strip()[:280]
    return first[:300]


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None
