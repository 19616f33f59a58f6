"""The fault injector: fires the run's scheduled faults and keeps each one's record.

A fault's record follows it through the controller: injected -> detected (the controller
knew) -> survivors resumed (a survivor committed a step begun after the injection) ->
rejoined (the respawned group committed a step with the others). Times are seconds after
the injection.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from monarch_sky.faults import PROCESS_KINDS, Fault
from monarch_sky.step_result import StepResult


@dataclass
class FaultRecord:
    fault: Fault
    rank: int | None  # None: the whole host
    injected_at: float  # time.monotonic()
    detected_at: float | None = None
    resumed_at: float | None = None  # a survivor committed a step begun after injection
    rejoined_at: float | None = None  # the respawned group committed a step with the others
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


class FaultInjector:
    def __init__(self, faults: list[Fault], seed: int, procs_per_replica: int, record, display, tracker):
        self.pending = list(faults)
        self.records: list[FaultRecord] = []
        self.rng = random.Random(seed)
        self.procs = procs_per_replica
        self.record = record
        self.display = display
        self.tracker = tracker

    def fire_due(self, replica: int, run_step: int, group, kill_host: Callable[[], None], step_seconds: float) -> None:
        """Inject every fault due for `replica` by `run_step` into its training `group`."""
        for fault in [f for f in self.pending if f.replica == replica and run_step >= f.step]:
            self.pending.remove(fault)
            delay = 0.5 * step_seconds  # land inside the step, as real failures do
            if fault.kind in PROCESS_KINDS:
                rank = self.rng.randrange(self.procs)
                group.inject(fault.kind, rank, delay)
                target = f"replica {replica} rank {rank}"
            else:
                rank = None
                asyncio.get_running_loop().call_later(delay, kill_host)
                target = f"replica {replica}'s host {group.host.name}"
            self.records.append(FaultRecord(fault, rank, injected_at=time.monotonic() + delay))
            self.record.event("fault_injected", kind=fault.kind, replica=replica, rank=rank, step=run_step)
            self.display.line(f"[fault] {fault.kind} -> {target} at step {run_step}")

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
            if rec.rejoined_at is None and r.participants < replicas:
                rec.steps_while_down.add(r.step)
            # The rejoiner's result for the same step may have been handled first.
            if rec.resumed_at is None:
                rec.resumed_at = now
                self.record.event("survivors_resumed", replica=rec.fault.replica, seconds=rec.seconds(now))

    def rejoined(self, replica: int, source: str, now: float) -> list[FaultRecord]:
        faults = self.open_faults(replica)
        for rec in faults:
            rec.rejoined_at, rec.recovered_from = now, source
            self.tracker.note({"fault/rejoined_s": rec.seconds(now)})
        return faults

    def recovered(self) -> int:
        return sum(r.rejoined_at is not None for r in self.records)
