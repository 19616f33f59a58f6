"""Which of a CPU host's processes get the cores first: recovery, then training, then standbys.

On CPU hosts the groups share the cores. A recovering group's imports and build come first
(at equal priority the busy survivors slow them 3x), the trainers next, and a standby warmed
while its group trains last, so the steps keep the cores. A recovery that claims a standby
still warming raises it back. On GPU hosts the trainers wait on the accelerator and nothing
here changes. Linux applies niceness per thread, so every thread of the process is reniced.
"""

from __future__ import annotations

import os
import threading

from monarch_sky.common.platform import detect

TRAINING_NICENESS = 5
STANDBY_NICENESS = 10  # a standby warming while the trainers step: below them
_claim = threading.Lock()
_claimed = False  # a recovery took this process: it never goes below the trainers again


def warm_below_training() -> None:
    """On CPU hosts, a standby warmed while its group trains imports below the trainers'
    priority, so the steps keep the cores; a recovery that claims it before it is ready
    raises it back (`claim_for_recovery`). On GPU hosts it uses host cores the trainers leave
    idle, so nothing changes."""
    with _claim:
        if detect().is_cpu and not _claimed:
            _renice(STANDBY_NICENESS)


def claim_for_recovery() -> None:
    """This process builds a recovering group's trainer: back to the priority a cold spawn has
    (raising it needs CAP_SYS_NICE, which root has; without it, it stays below the trainers)."""
    global _claimed
    with _claim:
        _claimed = True
        _renice(0)


def yield_cpu_to_recovery(kind: str) -> None:
    """Once its trainer is built, a process runs below those still starting up."""
    if kind == "cpu":
        _renice(TRAINING_NICENESS)  # a claimed standby's too (lowering it needs CAP_SYS_NICE; else it stays)


def _renice(niceness: int) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except (PermissionError, ProcessLookupError):
            pass
