"""Which of a CPU host's processes get the cores first: processes starting up, then trainers.

On CPU hosts the groups share the cores. A recovering group's imports and build come first
(at equal priority the busy survivors slow them 3x), and so does a standby warming while the
groups train: a standby left below the trainers took 40 s instead of 10 s to warm on 2 cores,
and the faults that found it not ready (7 s rejoins instead of 2.5 s under `make chaos`) cost
more than the steps it slowed. On GPU hosts the trainers wait on the accelerator and nothing
here changes. Linux applies niceness per thread, so every thread of the process is reniced.
"""

from __future__ import annotations

import os

TRAINING_NICENESS = 5


def yield_cpu_to_recovery(kind: str) -> None:
    """Once its trainer is built, a process runs below those still starting up."""
    if kind == "cpu":
        _renice(TRAINING_NICENESS)


def _renice(niceness: int) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except (PermissionError, ProcessLookupError):
            pass
