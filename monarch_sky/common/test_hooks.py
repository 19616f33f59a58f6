"""Switches that only tests set (environment variables `MONARCH_SKY_TEST_*`).

Each makes a real run misbehave in one precise way, so a test can drive a path that
would otherwise depend on luck. Users never set them.
"""

from __future__ import annotations

import os
import signal
from typing import Callable

REFUSE_REJOIN_COMMIT_ENV = "MONARCH_SKY_TEST_REFUSE_REJOIN_COMMIT"
PERTURB_REPLICA_ENV = "MONARCH_SKY_TEST_PERTURB_REPLICA"
BATCH_LOG_ENV = "MONARCH_SKY_TEST_BATCH_LOG"
HEAL_PACE_ENV = "MONARCH_SKY_TEST_HEAL_PACE"
HEAL_TIMEOUT_ENV = "MONARCH_SKY_TEST_HEAL_TIMEOUT_S"
LEAK_ENV = "MONARCH_SKY_TEST_LEAK"
DIE_AFTER_COMMIT_ENV = "MONARCH_SKY_TEST_DIE_AFTER_COMMIT"
FAIL_A_LOAD_ENV = "MONARCH_SKY_TEST_FAIL_A_LOAD"
REFILL_WARM_DELAY_ENV = "MONARCH_SKY_TEST_REFILL_WARM_DELAY_S"
STEP_PAUSE_ENV = "MONARCH_SKY_TEST_STEP_PAUSE_S"
REFUSE_COMMIT_ENV = "MONARCH_SKY_TEST_REFUSE_COMMIT"


def refuse_rejoin_commit() -> bool:
    """A rejoining generation's first commit is refused, as a failed step's would be."""
    return os.environ.get(REFUSE_REJOIN_COMMIT_ENV) == "1"


def perturb_replica(replica: int) -> bool:
    """This replica's weights are changed after its first commit (a negative control for
    the digest check; before that, TorchFT's first quorum syncs every group to one)."""
    return os.environ.get(PERTURB_REPLICA_ENV) == str(replica)


def batch_log_dir() -> str | None:
    """A folder where each rank logs the batches it kept and dropped."""
    return os.environ.get(BATCH_LOG_ENV)


def heal_pace_bytes_per_s() -> float:
    """A heal server sends no faster than this (0: at full speed): a heal made long on purpose."""
    return float(os.environ.get(HEAL_PACE_ENV, "0") or 0)


def step_pause_s() -> float:
    """Each trainer sleeps this long before each step (0: none): a run slow on purpose, so a
    test can stop it mid-run on any machine, however fast its steps."""
    return float(os.environ.get(STEP_PAUSE_ENV, "0") or 0)


def heal_timeout_s() -> float:
    """The heal transport's every bound, made small on purpose (0: the run's `ft.timeout_s`)."""
    return float(os.environ.get(HEAL_TIMEOUT_ENV, "0") or 0)


def refill_warm_delay_s() -> float:
    """A spare brought after the run's start (a refill) takes this much longer to warm: a long
    warm-up made on purpose, for a loss to land in (0: none)."""
    return float(os.environ.get(REFILL_WARM_DELAY_ENV, "0") or 0)


def leak_a_process(replica: int, rank: int) -> None:
    """Rank 0 of this replica starts a process in its own session that outlives the run's
    orderly stop (a negative control for the summary's `left_running`)."""
    if os.environ.get(LEAK_ENV) == str(replica) and rank == 0:
        import subprocess

        subprocess.Popen(["sleep", "600"], start_new_session=True)


def refuse_commit_at(replica: int, manager, progress: Callable[[], int]) -> None:
    """`REPLICA:STEP`: that replica's first generation fails the commit that would reach STEP,
    once its step's collectives are done (an error reported to TorchFT at `should_commit`), so
    its peers commit it: the group falls behind without a restart (in DiLoCo, a missed sync)."""
    wanted, _, step = os.environ.get(REFUSE_COMMIT_ENV, "").partition(":")
    if wanted != str(replica) or not step.isdigit():
        return
    decide, pending = manager.should_commit, [int(step)]

    def should_commit(*args, **kwargs) -> bool:
        if pending and progress() + 1 == pending[0]:
            pending.clear()
            manager.report_error(RuntimeError("test hook: this commit refused"))
        return decide(*args, **kwargs)

    manager.should_commit = should_commit


def die_after_commit(replica: int, rank: int, step: int, log_kept: Callable[[], None]) -> None:
    """`REPLICA:STEP`: that replica's rank 0, in its first generation, dies right after its
    group committed step STEP, before the step's answer leaves (`log_kept` first writes the
    batch log: those batches were trained)."""
    if os.environ.get(DIE_AFTER_COMMIT_ENV) == f"{replica}:{step}" and rank == 0:
        log_kept()
        os.kill(os.getpid(), signal.SIGKILL)


def fail_a_load(replica: int) -> bool:
    """`REPLICA:PATH`: that replica's first checkpoint load fails, as a flaky mount's would
    (PATH, created then, marks it spent: the processes that load later are new ones)."""
    wanted, _, marker = os.environ.get(FAIL_A_LOAD_ENV, "").partition(":")
    if wanted != str(replica) or not marker or os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True
