"""The fault injector: fires the run's scheduled faults and keeps each one's record.

A fault's record follows it through the controller: injected -> detected (the controller
knew) -> survivors resumed (a survivor committed a step begun after the injection) ->
rejoined (the respawned group committed a step with the others). Times are seconds after
the injection.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from monarch_sky.faults.schedule import FIRST_HEAL_S, chaos_draws, once_per_run, too_late
from monarch_sky.faults.spec import CONTROLLER, PROCESS_KINDS, REJOIN, SERVE, Fault
from monarch_sky.replica.step_result import HealInfo, StepResult


@dataclass
class FaultRecord:
    fault: Fault
    rank: int | None  # None: the whole host
    injected_at: float  # time.monotonic()
    generation: int  # the generation of the group it hit
    detected_at: float | None = None
    resumed_at: float | None = None  # a survivor committed a step begun after injection
    rejoined_at: float | None = None  # the respawned group committed a step with the others
    recovered_from: str | None = None  # "peer": weights from another group; "in place": no respawn
    steps_while_down: int = 0  # committed without the group
    last_down_step: int = 0  # (a count, not a set of steps: it never grows with a long outage)
    heal: HealInfo | None = None  # what the respawned group received from a peer
    # The longest survivor step beyond the median, from the step that served the heal to the
    # first one issued after the rejoin.
    survivors_pause_s: float | None = None
    pausing: bool = False
    host_replaced: dict | None = None  # a lost host's replacement: from the spare pool or not, how old
    quiet_commits: int = 0  # a comms fault's group: commits begun after it with no step failed


    def seconds(self, at: float | None) -> float | None:
        return None if at is None else round(at - self.injected_at, 3)

    def to_summary(self) -> dict[str, Any]:
        return {
            "kind": self.fault.kind,
            "replica": self.fault.replica,
            "step": self.fault.step,
            "during": self.fault.during or None,  # a compound fault: the recovery phase it hit
            "rank": self.rank,
            "detected_s": self.seconds(self.detected_at),
            "survivors_resumed_s": self.seconds(self.resumed_at),
            "rejoined_s": self.seconds(self.rejoined_at),
            "recovered_from": self.recovered_from,
            "steps_while_down": self.steps_while_down,
            "heal_bytes": self.heal.nbytes if self.heal else 0,
            "heal_step_s": self.heal.step_s if self.heal else None,
            "heal_s": self.heal.transfer_s if self.heal else None,
            "heal_gb_per_s": self.heal.gb_per_s if self.heal else None,
            "survivors_pause_s": self.survivors_pause_s,
            "host_replaced": self.host_replaced,
        }


class FaultInjector:
    def __init__(self, faults: list[Fault], seed: int, ranks_per_replica: int, record, display, tracker,
                 fired_before: list[str] = (), on_fired: Callable[[str], None] = lambda spec: None):
        self.pending = once_per_run(faults, fired_before)
        self.on_fired = on_fired  # told each scheduled fault's spec as it fires (kept beside the checkpoints)
        self.records: list[FaultRecord] = []
        self.rng = random.Random(seed)
        self.ranks = ranks_per_replica
        self.record = record
        self.display = display
        self.tracker = tracker

    def fire_due(self, replica: int, run_step: int, group, kill_host: Callable[[Any], None], step_seconds: float,
                 rejoining: bool = False) -> None:
        """Inject every fault due for `replica` by `run_step` into its `group`, and, when the
        group is a new generation's first step back, the replica's next `@rejoin` fault."""
        due = [f for f in self.pending if f.replica == replica and not f.during and run_step >= f.step]
        if rejoining:
            due += [f for f in self.pending if f.replica == replica and f.during == REJOIN][:1]
        for fault in due:
            self.pending.remove(fault)
            # Land inside the step, as real failures do; inside a heal step, early, in its heal.
            share = 0.5
            if fault.during:
                fault, share = Fault(fault.kind, run_step, fault.replica, fault.during), 0.25
            self.inject(fault, group, kill_host, delay_s=share * step_seconds, run_step=run_step, scheduled=True)

    def fire_serving(self, rejoiner: int, run_step: int, training: dict) -> None:
        """`rejoiner`'s new generation begins its first step back: arm the next `@serve` fault
        aimed at a group in `training` ({replica: slot}), which may serve that heal. Each of
        the group's processes fires it as it begins to send its state."""
        due = [f for f in self.pending if f.during == SERVE and f.replica != rejoiner and f.replica in training][:1]
        for fault in due:
            self.pending.remove(fault)
            slot = training[fault.replica]
            fault = Fault(fault.kind, run_step, fault.replica, SERVE)
            slot.group.inject_when_serving(fault.kind)
            self.records.append(FaultRecord(fault, None, time.monotonic(), slot.group.generation))
            self.on_fired(str(fault))
            self.record.event("fault_injected", kind=fault.kind, replica=fault.replica, rank=None, step=run_step,
                              during=SERVE, scheduled=str(fault))
            self.display.line(f"[fault] {fault.kind} -> replica {fault.replica} when it serves replica {rejoiner}'s "
                              f"heal, at step {run_step}")

    def fire_controller(self, run_step: int, step_seconds: float, resume_hint: str) -> None:
        """SIGKILL this controller inside the step that reaches a `controller@STEP` fault (its
        hosts and trainers live on, as when the controller's node dies)."""
        due = [f for f in self.pending if f.kind == CONTROLLER and run_step >= f.step][:1]
        for fault in due:
            self.pending.remove(fault)
            noted = self.on_fired(str(fault))
            self.record.event("fault_injected", kind=CONTROLLER, replica=None, rank=None, step=run_step,
                              during=None, scheduled=str(fault))
            self.display.line(f"[fault] {CONTROLLER} -> SIGKILL of this controller at step {run_step}; {resume_hint}")
            asyncio.ensure_future(_kill_this_process(0.5 * step_seconds, noted))

    def inject(self, fault: Fault, group, kill_host: Callable[[Any], None], delay_s: float, run_step: int,
               scheduled: bool = False) -> None:
        if fault.kind in PROCESS_KINDS:
            rank = self.rng.randrange(self.ranks)
            group.inject(fault.kind, rank, delay_s)
            target = f"replica {fault.replica} rank {rank}"
        else:
            rank = None
            # One of the group's hosts (a draw only when there is a choice: seeds keep their schedules).
            host = group.hosts[self.rng.randrange(len(group.hosts))] if len(group.hosts) > 1 else group.hosts[0]
            asyncio.get_running_loop().call_later(delay_s, kill_host, host)
            target = f"replica {fault.replica}'s host {host.name}"
        self.records.append(FaultRecord(fault, rank, time.monotonic() + delay_s, group.generation))
        if scheduled:
            self.on_fired(str(fault))
        self.record.event("fault_injected", kind=fault.kind, replica=fault.replica, rank=rank, step=run_step,
                          during=fault.during or None, scheduled=str(fault) if scheduled else None)
        during = f" (during its {fault.during})" if fault.during else ""
        self.display.line(f"[fault] {fault.kind} -> {target} at step {run_step}{during}")

    async def chaos(self, settings, replicas: int, steps: int, training: Callable[[], list], run_step: Callable[[], int],
                    time_left_s: Callable[[], float], recovering: Callable[[], list] = list) -> None:
        """Random faults at exponential gaps (mean `chaos.every_s`), reproducible from
        `chaos.seed` (`chaos_draws`: the same schedule `make bench` gives every arm). A
        fault goes only where another group keeps training to heal from, and only while the
        run has time left to heal it (`too_late`). (A real cluster makes no such promise:
        every group failing at once loses the state.) A share `chaos.during_recovery` of
        the draws that find a group `recovering()` aim at its heal instead (`@rejoin`)."""
        aim = random.Random(f"{settings.seed}/during_recovery")  # own draws: the schedule stays chaos_draws'
        for gap_s, kind, replica in chaos_draws(settings.every_s, settings.kinds, settings.seed, replicas):
            await asyncio.sleep(gap_s)
            # A group whose fault is not healed yet may not know it has failed: not eligible.
            ready = {slot.index: slot for slot in training() if not self.open_faults(slot.index)}
            late = too_late(run_step(), steps, time_left_s(), self.heal_allowance_s(kind))
            at_recovery = aim.random() < settings.during_recovery
            if at_recovery and ready and not late and self.aim_at_recovery(kind, replica, recovering(), run_step()):
                continue
            if replica not in ready or len(ready) < 2 or late:
                self.record.event("chaos_skipped", kind=kind, replica=replica, step=run_step(), training=len(ready),
                                  too_late=late)
                continue
            slot = ready[replica]
            fault = Fault(kind, max(run_step(), 1), replica)
            self.inject(fault, slot.group, slot.kill_host, delay_s=0.0, run_step=run_step())

    def aim_at_recovery(self, kind: str, replica: int, recovering: list, run_step: int) -> bool:
        """Arm a `@rejoin` fault for a group in recovery (`replica` if it is one), to fire in
        its next generation's heal step. False when no group is recovering without one."""
        armed = {f.replica for f in self.pending if f.during}
        targets = sorted(slot.index for slot in recovering if slot.index not in armed)
        if not targets:
            return False
        target = replica if replica in targets else targets[replica % len(targets)]
        self.pending.append(Fault(kind, 0, target, REJOIN))
        self.record.event("chaos_aimed_at_recovery", kind=kind, replica=target, step=run_step)
        return True

    def heal_allowance_s(self, kind: str) -> float:
        """How long a fault of `kind` may take to heal: 1.5 times the slowest heal of that kind
        in this run so far, or a first guess before one was seen."""
        seen = [r.rejoined_at - r.injected_at for r in self.records if r.fault.kind == kind and r.rejoined_at]
        return 1.5 * max(seen) if seen else FIRST_HEAL_S.get(kind, FIRST_HEAL_S["process"])

    def open_faults(self, replica: int) -> list[FaultRecord]:
        """Faults of `replica` whose group has not rejoined yet."""
        return [r for r in self.records if r.fault.replica == replica and r.rejoined_at is None]

    def detected(self, replica: int, at: float) -> list[FaultRecord]:
        """Mark the replica's undetected faults detected; returns them (none: unplanned)."""
        found = [r for r in self.open_faults(replica) if r.detected_at is None and r.injected_at <= at]
        for rec in found:
            rec.detected_at = at
            self.tracker.note({"fault/detected_s": rec.seconds(at)})
        return found

    def survivor_committed(self, r: StepResult, issued: float, replicas: int, now: float) -> None:
        """A group committed a cross-group step it issued at `issued`: resumes other replicas' faults."""
        for rec in self.records:
            if rec.fault.replica == r.replica or issued < rec.injected_at:
                continue
            if rec.rejoined_at is None and r.participants < replicas and r.step > rec.last_down_step:
                rec.steps_while_down += 1  # each step once, whichever survivor reports it first
                rec.last_down_step = r.step
            # The rejoiner's result for the same step may have been handled first.
            if rec.resumed_at is None:
                rec.resumed_at = now
                self.record.event("survivors_resumed", replica=rec.fault.replica, seconds=rec.seconds(now))

    def rejoined(self, replica: int, generation: int, source: str, now: float,
                 heal: HealInfo | None = None) -> list[FaultRecord]:
        """Generation `generation` of `replica` rejoined: it recovered from the faults of the
        generations before it. One aimed at itself (`@rejoin`) that lands after its rejoining
        commit stays open. `heal`: the step in which the group received the state."""
        faults = [rec for rec in self.open_faults(replica) if rec.generation != generation]
        for rec in faults:
            rec.rejoined_at, rec.recovered_from = now, source
            rec.heal = heal
            self.tracker.note({"fault/rejoined_s": rec.seconds(now)})
        return faults

    def host_replaced(self, replica: int, info: dict) -> None:
        for rec in self.open_faults(replica):
            rec.host_replaced = info

    def served(self, r: StepResult, pause_s: float) -> None:
        """Group `r.replica` staged its state for a rejoining peer in this step: the newest
        fault of another group still waiting for its heal starts counting the survivors' pause."""
        self.record.event("heal_served", replica=r.replica, step=r.step, bytes=r.served_bytes,
                          snapshot_s=round(r.snapshot_s, 3), step_s=round(r.seconds, 3), pause_s=round(pause_s, 3))
        waiting = [rec for rec in self.records if rec.fault.replica != r.replica and rec.survivors_pause_s is None
                   and rec.recovered_from is None]
        if waiting:
            waiting[-1].pausing = True

    def survivor_step(self, r: StepResult, issued: float, pause_s: float) -> None:
        """A survivor's step took `pause_s` longer than the median: counted for the heals it waited on."""
        for rec in self.records:
            if rec.pausing and rec.fault.replica != r.replica:
                rec.survivors_pause_s = max(rec.survivors_pause_s or 0.0, round(pause_s, 3))
                if rec.rejoined_at is not None and issued > rec.rejoined_at:
                    rec.pausing = False

    def same_generation_result(self, r: StepResult, generation: int, issued: float, now: float) -> list[FaultRecord]:
        """The group a fault hit answered without a respawn (a comms fault TorchFT
        reconfigures around): its first failed step after the fault is the detection, its
        next cross-group commit (a step begun after the fault) the recovery. A fault that
        failed no step stays open, except a comms fault absorbed by a reconfiguration
        (`_absorbed`). Returns the faults it recovered from."""
        recovered = []
        for rec in self.open_faults(r.replica):
            if rec.generation != generation or now < rec.injected_at:
                continue
            if not r.committed and rec.detected_at is None:
                rec.detected_at = now
            elif r.synced and rec.detected_at is not None and issued >= rec.injected_at:
                rec.rejoined_at, rec.recovered_from = now, "in place"
                recovered.append(rec)
            elif r.synced and rec.fault.kind == "comms" and issued >= rec.injected_at:
                self._absorbed(rec, now)
        return recovered

    def _absorbed(self, rec: FaultRecord, now: float) -> None:
        """A comms abort that fails no step was absorbed: a quorum change made TorchFT replace
        the aborted process group before a collective used it (seen when another group failed
        just before). Two commits begun after it: an abort that lands fails the first
        collective after it, so by the second it has landed or never will."""
        rec.quiet_commits += 1
        if rec.quiet_commits < 2:
            return
        rec.rejoined_at, rec.recovered_from = now, "in place"
        self.record.event("fault_absorbed", kind=rec.fault.kind, replica=rec.fault.replica, seconds=rec.seconds(now))
        self.display.line(f"[replica {rec.fault.replica}] the {rec.fault.kind} fault failed no step: TorchFT "
                          "replaced the aborted process group at a quorum change before it was used")

    def recovered(self) -> int:
        return sum(r.rejoined_at is not None for r in self.records)


NOTE_BACKSTOP_S = 30.0  # a note's host calls time out by themselves well before this


async def _kill_this_process(delay_s: float, noted) -> None:
    """SIGKILL this controller after `delay_s`, once the fault is noted where the next
    controller looks (`noted`: a task writing it to node memory), so it never fires twice."""
    await asyncio.sleep(delay_s)
    if noted is not None:  # its calls are bounded (seconds); this only backs them up
        await asyncio.wait({noted}, timeout=NOTE_BACKSTOP_S)
    os.kill(os.getpid(), signal.SIGKILL)
