"""The step ledger: what the run committed, step by step.

Each replica group's `StepResult` lands here. A step counts once a group committed it. Its
loss is the mean over the groups that committed it with weights of their own: a group that
healed during the step computed its loss on fresh weights, so that loss is left out. A step
is logged (W&B, the live status line, progress events) once the run has moved past it.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from monarch_sky.replica.step_result import StepResult

QUORUM_HISTORY = 1024  # steps whose quorum members are kept (bounded at any run length)
DATA_HISTORY = 8  # steps of data positions kept per group, to note each group's at a saved step


@dataclass
class StepStats:
    first_seen: float
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    quorum: int = 0
    replicas: set[int] = field(default_factory=set)

    def loss(self) -> float | None:
        return round(sum(self.losses) / len(self.losses), 4) if self.losses else None


@dataclass(frozen=True)
class StatusCounts:
    replicas: int
    training: int
    faults: int
    recovered: int


LINES_KEPT = 20_000  # step lines `between_steps` reads at the end: the run's recent steady state


def between_steps(lines: list[dict]) -> float | None:
    """Median seconds a replica spent outside its steps between consecutive committed ones
    (its step's end to the next one's start): for monarch-sky, the controller's turn."""
    last: dict[int, dict] = {}
    gaps = []
    for line in sorted(lines, key=lambda x: x["wall"]):
        if not line["committed"]:
            last.pop(line["replica"], None)
            continue
        before = last.get(line["replica"])
        if before is not None and line["step"] == before["step"] + 1:
            gaps.append(max(0.0, line["wall"] - before["wall"] - line["seconds"]))
        last[line["replica"]] = line
    return round(statistics.median(gaps), 4) if gaps else None


class StepLedger:
    def __init__(self, target: int, record, tracker, display, counts: Callable[[], StatusCounts]):
        self.target = target
        self.record = record
        self.tracker = tracker
        self.display = display
        self.counts = counts
        self.steps: dict[int, StepStats] = {}  # the steps not yet logged, and the last one logged
        self.losses: dict[str, float | None] = {"first": None, "last": None}  # of the logged steps
        self.run_step = 0  # the highest step any group committed
        self.logged_step = 0
        self.start_time = time.monotonic()
        self.step_seconds = 1.0  # moving average, used to land faults mid-step
        self._recent = deque(maxlen=50)  # seconds of recent committed steps
        self.quorums: dict[int, tuple[str, ...]] = {}  # step -> the members of the quorum that committed it
        self.lines: deque = deque(maxlen=LINES_KEPT)  # recent step lines, for `between_steps`

    def add(self, r: StepResult, now: float) -> None:
        self.step_seconds = 0.8 * self.step_seconds + 0.2 * r.seconds
        wall = time.time() - (time.monotonic() - now)  # `now` is earlier for a step that came in a batch
        self.record.step(r.replica, r.step, r.committed, r.seconds, r.loss, r.participants, wall)
        self.lines.append({"wall": now, "replica": r.replica, "step": r.step, "committed": r.committed, "seconds": r.seconds})
        if not r.committed:
            return
        self._recent.append(r.seconds)
        self._keep_quorum(r)
        stats = self.steps.setdefault(r.step, StepStats(first_seen=now))
        if r.loss is not None:
            stats.losses.append(r.loss)
        stats.tokens += r.tokens
        stats.quorum = max(stats.quorum, r.participants)
        stats.replicas.add(r.replica)
        self.run_step = max(self.run_step, r.step)
        self.flush()

    def between_steps(self) -> dict | None:
        """The controller's share of a step: median seconds between a group's steps, against
        the median step (`summary.json`)."""
        gap = between_steps(list(self.lines))
        steps = [line["seconds"] for line in self.lines if line["committed"]]
        if gap is None or not steps:
            return None
        step = statistics.median(steps)
        return {"median_s": gap, "step_s": round(step, 4), "share": round(gap / (gap + step), 4)}

    def _keep_quorum(self, r: StepResult) -> None:
        if not (r.synced and r.quorum):
            return
        self.quorums.pop(r.step, None)  # the latest commit of a step number counts (after a progress loss)
        self.quorums[r.step] = tuple(sys.intern(m) for m in r.quorum)
        while len(self.quorums) > QUORUM_HISTORY:
            del self.quorums[next(iter(self.quorums))]

    def rewind(self, step: int) -> None:
        """Training went back to a checkpoint at `step`: the steps after it are trained again.
        They are logged once, as the run passes the last step it had logged (W&B's step only grows)."""
        self.run_step = step
        for later in [s for s in self.steps if s > step]:
            del self.steps[later]

    def flush(self, final: bool = False) -> None:
        """Log each step once the run has moved past it (or at the end)."""
        last = self.run_step if final else self.run_step - 1
        for step in range(self.logged_step + 1, last + 1):
            stats = self.steps.get(step)
            if stats is not None:
                self._log(step, stats)
        self.logged_step = max(self.logged_step, last)
        # Bounded at any length of run: a logged step is kept only as the next one's "previous".
        for step in [s for s in self.steps if s < self.logged_step]:
            del self.steps[step]

    def _log(self, step: int, stats: StepStats) -> None:
        prev = self.steps.get(step - 1)
        elapsed = stats.first_seen - (prev.first_seen if prev else self.start_time)
        tps = stats.tokens / elapsed if elapsed > 0 else 0.0
        loss = stats.loss()
        if loss is not None:
            self.losses["first"] = self.losses["first"] if self.losses["first"] is not None else loss
            self.losses["last"] = loss
        metrics = {"tokens_per_s": tps, "quorum_size": stats.quorum, "participating_replicas": len(stats.replicas)}
        if loss is not None:
            metrics["loss"] = loss
        self.tracker.log(metrics, step=step)
        if step % max(1, self.target // 20) == 0:
            self.record.event("progress", step=step, loss=loss)
        c = self.counts()
        self.display.status(step, loss, tps, stats.quorum, c.replicas, c.training, c.faults, c.recovered)

    def median_step_s(self) -> float:
        return statistics.median(self._recent) if self._recent else self.step_seconds

    def first_and_last_loss(self) -> dict[str, float | None]:
        """Of the logged steps: call after `flush(final=True)`."""
        return dict(self.losses)


class DataHistory:
    """Each group's data positions (per rank) at its recent steps: what a checkpoint's or a
    node-memory snapshot's note records for the step it was taken at."""

    def __init__(self) -> None:
        self._at: dict[int, dict[int, tuple]] = {}  # replica -> step -> per-rank data states

    def add(self, r: StepResult) -> None:
        history = self._at.setdefault(r.replica, {})
        history[r.step] = r.data_states
        for old in [s for s in history if s <= r.step - DATA_HISTORY]:
            del history[old]

    def at(self, replica: int, step: int) -> tuple | None:
        return self._at.get(replica, {}).get(step)
