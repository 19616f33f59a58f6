"""The run's state in node memory, from the controller's side (`monarch_sky.common.node_memory`).

Every trainer rank keeps its latest committed state in its node's memory
(`monarch_sky.replica.node_state`); the controller adds what only it knows, through the host
agents on every group's hosts:
- after each snapshot step S that every training group has passed, a note of every group's
  data position at S; and the run's own note (its step, the scheduled faults fired), which a
  fired fault updates at once, so a controller that comes back never fires it again;
- at a start under a run id that may exist already, what each host holds (`survey`): `choose`
  picks the newest step whose snapshot some group's hosts hold whole. Those groups load it at
  setup, the others heal from them live, and training goes on from that step;
- at the run's orderly end, the memory is given back (`forget`).
Each note carries the controller's claim, (epoch, owner token): a host claimed by a controller
that orders after it (a newer epoch, or the same epoch and a greater token: two standbys that
woke at once) refuses its notes (the fence, `NodeMemory.fenced_by`). A controller claims every
host before it reaps anything there, so the loser of a tie never kills the winner's processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import statistics
import time
from collections import Counter
from typing import Any

from monarch_sky.common.supervision import resolved
from monarch_sky.control.checkpoint_resume import fingerprint, refuse_other_settings
from monarch_sky.control.context import RunContext
from monarch_sky.control.memory_point import MemoryPoint, choose, snapshot_every
from monarch_sky.control.slot_state import SlotState
from monarch_sky.faults.schedule import once_per_run
from monarch_sky.hosts.base import LOST_AT_ENV

log = logging.getLogger(__name__)

CALL_S = 5.0  # a host agent answers a note in milliseconds: one that does not is skipped


class Superseded(RuntimeError):
    """A newer controller of this run claimed its hosts: this one must stop driving it."""


class NodeMemory:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.every = snapshot_every(ctx.cfg)
        self.settings = fingerprint(ctx.cfg)  # what each run note says the run was started with
        self.epoch = 1  # this controller's: one more than any the hosts were claimed by (`survey`)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"  # tells a tie apart
        self.noted = 0  # the newest snapshot step noted
        self.fired: list[str] = []  # scheduled faults fired, by this controller and those before it
        self.fenced_by: int | None = None  # a newer controller's epoch, once a host said so
        self.point: MemoryPoint | None = None  # where the run went on from, if from node memory
        self.restored: dict[str, Any] | None = None  # what the summary says of it (`go_on_from`)
        self.steps, self.wait_s = 0, 0.0  # group steps seen, and what they waited for snapshot copies
        self.writes_s: list[float] = []  # each group's copy seconds, per step that finished one
        self.errors: list[dict] = []

    async def survey(self, agents: list) -> MemoryPoint | None:
        """What the slots' hosts hold of this run (`agents`: each slot's host agent mesh), and
        the point to go on from, if any. Claims every host first, then reaps what an earlier
        controller left running there; None and `fenced_by` set if another controller holds one."""
        slot_hosts = self._slot_hosts()
        listings = await self._listings(agents, slot_hosts)
        self.epoch = 1 + max((listing.get("epoch", 0) for listing in listings.values()), default=0)
        run_id, bound = self.ctx.cfg.run_id, self.ctx.cfg.timeouts.stop_s
        claims = await self._gather((a.note.call(run_id, self.epoch, self.owner, None, None) for a in agents), bound)
        if self._hear(claims, at="survey"):
            return None
        reaps = await self._gather((a.reap_others.call() for a in agents), bound)
        reaped = sum(sum(per_host.values()) for per_host in reaps)
        listings = await self._listings(agents, slot_hosts)  # what the reaped processes finished meanwhile
        found = choose(listings, slot_hosts, self.ctx.cfg.procs_per_replica, self.ctx.cfg.steps)
        held = sum(len(listing["snapshots"]) for listing in listings.values())
        self.ctx.record.event("node_memory_surveyed", hosts=len(listings), snapshots=held, epoch=self.epoch,
                              step=found.step if found else None, reaped_processes=reaped)
        return found

    def _slot_hosts(self) -> dict[int, list[str]]:
        return {slot.index: [h.address for h in slot.hosts] for slot in self.ctx.slots}

    @staticmethod
    async def _gather(calls, bound: float) -> list[dict]:
        """The host agents' answers to `calls` at once, each bounded by `bound`, in order; hosts
        that did not answer answer nothing (their memory, if any, cannot be reached either)."""
        answers = await asyncio.gather(*(asyncio.wait_for(resolved(c), bound) for c in calls), return_exceptions=True)
        for error in (a for a in answers if isinstance(a, BaseException)):
            log.info("a host agent did not answer about node memory: %s", error)
        return [{} if isinstance(a, BaseException) else a for a in answers]

    def _hear(self, answers: list[dict], **where) -> bool:
        """The fence: whether the hosts' answers (each the claim that holds it) name a controller
        that orders after this one, for the first time (then `fenced_by` is its epoch)."""
        claim = (self.epoch, self.owner)
        newer = max((tuple(held) for per_host in answers for held in per_host.values()), default=claim)
        if newer <= claim or self.fenced_by is not None:
            return False
        self.fenced_by = newer[0]
        self.ctx.record.event("controller_fenced", epoch=self.epoch, newer_epoch=newer[0], **where)
        return True

    async def _listings(self, agents: list, slot_hosts: dict[int, list[str]]) -> dict[str, dict]:
        run_id = self.ctx.cfg.run_id
        answers = await self._gather((a.memory.call(run_id) for a in agents), self.ctx.cfg.timeouts.stop_s)
        return {slot_hosts[index][point["hosts"]]: listing
                for index, per_host in zip(slot_hosts, answers) for point, listing in per_host.items()}

    def after_step(self, r) -> None:
        """Account a step's snapshot work (`r`: its StepResult); note the newest snapshot step
        every training group has passed, once."""
        self._account(r)
        if self.restored is not None and self.restored.get("training_again_wall") is None \
                and self.ctx.ledger.run_step > self.restored["step"]:
            self.restored["training_again_wall"] = time.time()
            self.ctx.record.event("training_again", step=self.ctx.ledger.run_step)
        if not self.every or self.fenced_by is not None:
            return
        training = [s for s in self.ctx.slots if s.state in (SlotState.TRAINING, SlotState.DONE)]
        if not training:
            return
        step = min(s.step for s in training) // self.every * self.every
        if step > self.noted:
            self.noted = step
            self.ctx.in_background(self._note(step))

    async def _note(self, step: int) -> None:
        history = self.ctx.data_history
        data, skip = {}, {}
        for slot in self.ctx.slots:
            at = history.at(slot.index, step)
            data[str(slot.index)] = list(at if at is not None else slot.data_states)
            if at is None and slot.skip_steps:
                skip[str(slot.index)] = slot.skip_steps
        await self._write(step, {"step": step, "data_states": data, "skip_steps": skip})
        await self.write_run_note()

    def note_fault_fired(self, spec: str) -> asyncio.Task:
        self.fired.append(spec)
        return self.ctx.in_background(self.write_run_note())

    async def write_run_note(self) -> None:
        await self._write(None, {"run_step": self.ctx.ledger.run_step, "faults_fired": self.fired,
                                 "epoch": self.epoch, "wall": time.time(), "settings": self.settings})

    def _account(self, r) -> None:
        self.steps += 1
        self.wait_s += r.memory_wait_s
        if r.memory_write_s > 0:
            self.writes_s.append(r.memory_write_s)
        if r.memory_error and not self.errors:  # once: every later snapshot would say the same
            self.ctx.display.line(f"monarch-sky: WARNING: replica {r.replica} could not keep its state in node "
                                  f"memory: {r.memory_error}; a controller's loss would go back further")
        if r.memory_error:
            self.errors.append({"replica": r.replica, "step": r.step, "error": r.memory_error})
            self.ctx.record.event("node_memory_failed", replica=r.replica, step=r.step, error=r.memory_error)

    def _agents(self, live_only: bool) -> list:
        """The slots' host agents; `live_only`: of the slots whose hosts are up (a mesh with a dead
        host would hold a call until its bound)."""
        live = (SlotState.TRAINING, SlotState.REJOINING, SlotState.DONE)
        return [s.agent for s in self.ctx.slots if s.agent is not None and (s.state in live or not live_only)]

    async def _ask_all(self, call, live_only: bool = True) -> list[dict]:
        """`call(agent)` on the slots' hosts at once, each bounded (`_gather`)."""
        bound = min(CALL_S, self.ctx.cfg.timeouts.stop_s)
        return await self._gather((call(a) for a in self._agents(live_only)), bound)

    async def _write(self, step: int | None, note: dict[str, Any]) -> None:
        run_id = self.ctx.cfg.run_id
        if self._hear(await self._ask_all(lambda agent: agent.note.call(run_id, self.epoch, self.owner, step, note))):
            self.ctx.display.line(f"monarch-sky: a newer controller of this run (epoch {self.fenced_by}) claimed its "
                                  f"hosts: this one (epoch {self.epoch}) stops driving it and leaves them be")

    async def held_by(self, slot) -> MemoryPoint | None:
        """The newest state `slot`'s own hosts hold whole, for its next generation to load
        (every group holding the state failed at once); None if they hold none."""
        if slot.agent is None:
            return None
        try:
            answers = await asyncio.wait_for(resolved(slot.agent.memory.call(self.ctx.cfg.run_id)), CALL_S)
        except Exception as e:  # noqa: BLE001 - an agent on a dead host: its memory is gone anyway
            log.info("replica %d's hosts could not say what node memory holds: %s", slot.index, e)
            return None
        hosts = [h.address for h in slot.hosts]
        listings = {hosts[point["hosts"]]: listing for point, listing in answers.items()}
        return choose(listings, {slot.index: hosts}, self.ctx.cfg.procs_per_replica, self.ctx.cfg.steps + 1)

    def cost(self) -> dict[str, Any]:
        """`node_memory` in the summary: the snapshots' interval and what they cost the steps."""
        return {"every_steps": self.every, "group_steps": self.steps, "snapshots": len(self.writes_s),
                "copy_s_median": round(statistics.median(self.writes_s), 4) if self.writes_s else None,
                "wait_s_per_step": round(self.wait_s / self.steps, 5) if self.steps else None,
                "errors": self.errors[:10]}

    def summary(self) -> dict[str, Any] | None:
        """`controller_lost` in the summary: where the run went on from, what it lost, and how
        long after the loss (the lost controller's last record) it was seen and trained again."""
        if self.restored is None:
            return None
        out = {k: v for k, v in self.restored.items() if not k.endswith("_wall")}
        lost, seen, again = (self.restored.get(k) for k in ("lost_wall", "seen_wall", "training_again_wall"))
        out["detected_s"] = round(seen - lost, 3) if lost and seen else None
        out["training_again_s"] = round(again - lost, 3) if lost and again else None
        return out

    async def forget(self) -> int:
        """Give the run's node memory back on every host a slot holds; bytes freed."""
        answers = await self._ask_all(lambda agent: agent.forget.call(self.ctx.cfg.run_id), live_only=False)
        freed = sum(sum(per_host.values()) for per_host in answers)
        self.ctx.record.event("node_memory_freed", bytes=freed)
        return freed


def after_loss_hint(cfg) -> str:
    """What happens after the controller's loss (the `controller@STEP` fault says it)."""
    if cfg.controller.standby:
        return "the standby starts another, which goes on from the hosts' node memory"
    return f"run it again with run_id={cfg.run_id} to go on from the hosts' node memory or its checkpoint"


def restarted_without_memory(ctx: RunContext, previous: dict[str, Any]) -> dict[str, Any]:
    """What the summary says of a restart that found nothing in node memory: it went on from the
    checkpoint it resumed from, or from step 0."""
    resume = ctx.checkpoints.resume
    step = resume.step if resume is not None else 0
    last = max(previous.get("last_step", 0), step)
    return {"restored_from": "checkpoint" if resume is not None else "scratch", "step": step, "last_step": last,
            "steps_lost": last - step, "lost_wall": previous.get("last_wall"),
            "seen_wall": float(os.environ.get(LOST_AT_ENV, 0)) or None}


def go_on_from(ctx: RunContext, point: MemoryPoint, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Set the run up to go on from `point`: the ledger at its step, each slot's step and data
    position, the faults fired before; returns what the summary says of it (`controller_lost`).
    Raises CheckpointMismatch if the run that left it had another shape or settings (a run id
    used again: its trainers could not load it, and would fail at setup)."""
    refuse_other_settings(ctx.cfg, point.run_note.get("settings", {}),
                          f"the state of run {ctx.cfg.run_id} at step {point.step} in its hosts' node memory",
                          f"that memory stays on the hosts until a run under id {ctx.cfg.run_id} ends")
    fired_here = Counter((previous or {}).get("faults_fired", []))
    fired = fired_here | Counter(point.run_note.get("faults_fired", []))
    ctx.injector.pending = once_per_run(ctx.injector.pending, list((fired - fired_here).elements()))
    ctx.memory.fired = list(fired.elements())
    ctx.memory.noted = point.step
    ctx.ledger.run_step = ctx.ledger.logged_step = point.step
    for slot in ctx.slots:
        slot.step = point.step
        slot.data_states = point.data_states.get(slot.index, ())
        slot.skip_steps = point.skip_steps.get(slot.index, 0)
    previous = previous or {}
    last = max(previous.get("last_step", 0), point.run_note.get("run_step", 0), point.step)
    lost = {"restored_from": "memory", "step": point.step, "last_step": last, "steps_lost": last - point.step,
            "loaded_by": list(point.loaders), "hosts": list(point.hosts), "data_estimated": list(point.estimated),
            "lost_wall": previous.get("last_wall") or point.run_note.get("wall"),
            "seen_wall": float(os.environ.get(LOST_AT_ENV, 0)) or None}  # a standby's word
    ctx.record.event("restored_from_memory", **lost)
    loaded = ", ".join(str(i) for i in point.loaders)
    others = "" if len(point.loaders) == len(ctx.slots) else ", the others heal from them"
    ctx.phase(f"going on from step {point.step} held in node memory ({last - point.step} steps lost): replica "
              f"group(s) {loaded} load it on their hosts{others}")
    return lost
