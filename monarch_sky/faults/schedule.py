"""When faults fire: the chaos schedule, once per run across controllers, and too late to heal.

Pure functions of their inputs, so a schedule is the same for every arm of `make bench` and
for every controller of one run.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Iterator

from monarch_sky.faults.spec import Fault


# Before a run has healed a fault of a kind: a guess at how long one takes (a host: a new
# host or a spare, a spawn, a heal; a process: the standby builds and heals).
FIRST_HEAL_S = {"host": 30.0, "process": 10.0}


def too_late(run_step: int, steps: int, time_left_s: float, heal_s: float) -> bool:
    """Whether a chaos fault now would likely end the run before it heals: in the last tenth
    of the steps, or with less time left at the current pace than the heal takes. (The last
    tenth alone was not enough: a host fault 21 steps from the end of a fast run left 3 s.)"""
    return run_step >= 0.9 * steps or time_left_s < heal_s


def once_per_run(faults: list[Fault], fired_before: list[str]) -> list[Fault]:
    """The scheduled faults an earlier controller of this run did not fire (`fired_before`:
    their specs, one entry per firing), so that a restart does not fire one twice."""
    left = Counter(fired_before)
    pending = []
    for fault in faults:
        if left[str(fault)] > 0:
            left[str(fault)] -= 1
        else:
            pending.append(fault)
    return pending


def chaos_draws(every_s: float, kinds, seed: int, replicas: int) -> Iterator[tuple[float, str, int]]:
    """The chaos schedule, a pure function of its settings: (seconds since the previous
    draw, fault kind, target replica), forever."""
    rng = random.Random(seed)
    kinds = list(kinds)
    while True:
        yield rng.expovariate(1.0 / every_s), rng.choice(kinds), rng.randrange(replicas)
