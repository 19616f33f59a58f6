"""The chaos schedule injected from outside, into arms that run without Monarch.

The draws are monarch-sky's own (`schedule.chaos_draws`: gap, kind, replica from the seed)
and follow its rules: the clock starts with the arm's first step, a fault goes only to a
replica that is not still recovering from an earlier one while another keeps training, and
the last tenth of the run gets none. A single job (checkpoint-restart) has nothing running
while it restarts, so its clock stops then: it meets faults at the same rate per second of
training as the others, instead of skipping every draw that falls in a restart (which gave
it about half as many faults as monarch-sky in the same wall time). A fault is the same act as in monarch-sky: kill
(SIGKILL), segfault (SIGSEGV) and stop (SIGSTOP) hit one rank of the replica; host kills
the replica's whole launch (the job, for a single-job arm) and relaunches it after the
provisioning delay.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path
from typing import Callable

from monarch_sky.bench.launch import Launch, signal_pid_file
from monarch_sky.faults.schedule import chaos_draws
from monarch_sky.record.jsonl import JsonlTail

SIGNALS = {"kill": signal.SIGKILL, "segfault": signal.SIGSEGV, "stop": signal.SIGSTOP}
KINDS = (*SIGNALS, "host")


class OutsideChaos:
    def __init__(self, arm_dir: Path, settings, launch_of: Callable[[int], Launch], single_job: bool,
                 excluded: tuple[str, ...] = ()):
        self.dir = arm_dir
        self.s = settings
        self.launch_of = launch_of  # replica -> the launch a host fault kills
        self.single_job = single_job
        self.draws = chaos_draws(settings.every_s, settings.kinds, settings.seed, settings.replicas)
        self.rank_rng = random.Random(settings.seed + 1)
        self.faults: list[dict] = []
        self.excluded = excluded  # kinds this arm's own stack cannot see: drawn, never injected
        self.skipped: dict[str, int] = {}
        self.next_at: float | None = None  # wall time of the next draw
        self.pending: tuple[str, int] | None = None
        self.steps = JsonlTail(arm_dir / "steps.jsonl")
        self.last_tick = time.time()

    def tick(self) -> None:
        lines = self.steps.read()
        self._note_restarts()
        now, since = time.time(), time.time() - self.last_tick
        self.last_tick = now
        if not lines:
            return
        if self.next_at is None:
            self.next_at = lines[0]["wall"] - lines[0]["seconds"]
        if self.single_job and any(not self._recovered(f, lines) for f in self.faults):
            self.next_at += since  # restarting: the job's fault clock stops
        while self.next_at <= now:
            if self.pending is not None:
                self._maybe_inject(*self.pending, lines)
            gap, kind, replica = next(self.draws)
            self.next_at += gap
            self.pending = (kind, replica)

    def _maybe_inject(self, kind: str, replica: int, lines: list[dict]) -> None:
        run_step = max((line["step"] for line in lines if line["committed"]), default=0)
        recovering = {f["replica"] for f in self.faults if not self._recovered(f, lines)}
        ready = set() if self.single_job and recovering else set(range(self.s.replicas)) - recovering
        if replica not in ready or len(ready) < 2 or run_step >= 0.9 * self.s.steps:
            return
        if kind in self.excluded:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            return
        fault = {"wall": round(time.time(), 3), "kind": kind, "replica": replica, "rank": None,
                 "step": run_step, "restarted_wall": None}
        if kind == "host":
            self.launch_of(replica).lose_host(self.s.provision_delay_s)
        else:
            fault["rank"] = self.rank_rng.randrange(self.s.procs)
            fault["pid"] = self._signal(replica, fault["rank"], SIGNALS[kind])
        self.faults.append(fault)

    def _signal(self, replica: int, rank: int, sig: signal.Signals) -> int | None:
        return signal_pid_file(self.dir / "pids" / f"replica{replica}-rank{rank}.pid", sig)

    def _note_restarts(self) -> None:
        """A fault's target is back when its rank 0 wrote a newer pid file."""
        for fault in self.faults:
            if fault["restarted_wall"] is None:
                pid_file = self.dir / "pids" / f"replica{fault['replica']}-rank0.pid"
                if pid_file.exists() and pid_file.stat().st_mtime > fault["wall"]:
                    fault["restarted_wall"] = round(pid_file.stat().st_mtime, 3)

    def _recovered(self, fault: dict, lines: list[dict]) -> bool:
        back = fault["restarted_wall"]
        owner = -1 if self.single_job else fault["replica"]
        return back is not None and any(
            line["committed"] and line["replica"] == owner and line["wall"] - line["seconds"] >= back for line in lines
        )

    def write(self) -> None:
        with open(self.dir / "faults.jsonl", "w") as out:
            for fault in self.faults:
                out.write(json.dumps(fault) + "\n")
