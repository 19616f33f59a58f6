"""One benchmark arm's numbers, computed the same way for every arm from its records.

Every arm writes `steps.jsonl` (one line per step a replica group, or for a single-job arm
the whole job as replica -1, ended: wall, step, committed, seconds, loss, participants) and
the bench writes `faults.jsonl` (wall, kind, replica, and for faults injected from outside
the time the target's processes came back). The definitions:

- kept step: the last committed line of each (replica, step); a step redone after a restart
  from a checkpoint keeps only its last run, the earlier ones were lost work;
- step efficiency: kept lines / all lines (attempted steps);
- goodput: seconds of kept steps / (replica keys x wall seconds): the share of group-time in
  steps that stood. A slower step counts as more of it, so it says nothing about step speed;
- run step: the highest step committed so far; time to target: when it reached `steps`.
  On one shared machine a run with groups down steps faster (the others get their cores),
  so time to target favours an arm that keeps fewer groups training;
- work rate: kept group-steps (batches trained that stood) per second up to the target: the
  trained data the wall time bought (TorchFT's step averages over the groups in it, so a
  step with fewer groups trains on less);
- median step: median gap between the first commits of consecutive run steps;
- group step: the median over groups of each group's median gap between its own consecutive
  committed steps. In DiLoCo the groups' inner steps are not in lockstep, and the run step
  advances with whichever group is ahead, so the median step there is shorter than any group's;
- steady step: the median over groups of each group's mean step over the second half of the
  run's steps, when start-up is over (monarch-sky's standbys warm during the first ones, on the
  same cores here; on GPU nodes they use host CPUs the steps do not);
- between steps: median time a group spends outside its own step, from one step's end to the
  next one's (consecutive steps of one replica: the gap in wall time less the step's own
  seconds). For monarch-sky that is the controller's turn (result back, next call out); for
  TorchTitan alone, its loop around `train_step`;
- first step: seconds from the arm's launch to its first committed step (start-up: spawn,
  imports, build, and for monarch-sky whatever it does before training);
- per fault: resumed = the first commit of another group's step begun after the fault (a
  single job: begun after its processes came back), rejoined = the target's first commit
  begun after it came back, regained = the run step back where it was when the fault hit.
"""

from __future__ import annotations

import statistics
from typing import Any

from monarch_sky.control.ledger import between_steps


def kept_lines(lines: list[dict]) -> list[dict]:
    last: dict[tuple[int, int], dict] = {}
    for line in lines:
        if line["committed"]:
            last[(line["replica"], line["step"])] = line
    return sorted(last.values(), key=lambda line: line["wall"])


def first_commits(lines: list[dict]) -> dict[int, float]:
    """Run step -> wall time it was first committed by anyone (a new high)."""
    firsts: dict[int, float] = {}
    high = 0
    for line in lines:
        if line["committed"] and line["step"] > high:
            high = line["step"]
            firsts[high] = line["wall"]
    return firsts


def arm_stats(lines: list[dict], started: float, ended: float, target: int) -> dict[str, Any]:
    wall_s = ended - started
    kept = kept_lines(lines)
    keys = {line["replica"] for line in lines} or {0}
    firsts = first_commits(lines)
    reached = [wall for step, wall in firsts.items() if step >= target]
    to_target = reached[0] - started if reached else None
    return {
        "wall_s": round(wall_s, 2),
        "committed_steps": max(firsts, default=0),
        "attempted_steps": len(lines),
        "step_efficiency": _ratio(len(kept), len(lines)),
        "goodput": _ratio(sum(line["seconds"] for line in kept), len(keys) * wall_s),
        "time_to_target_s": round(to_target, 2) if to_target else None,
        "work_rate": _ratio(sum(line["wall"] <= reached[0] for line in kept), to_target) if to_target else None,
        "loss_at_target": _loss_at(kept, target),
        "median_step_s": _median_gap(firsts),
        "group_step_s": _group_step(lines),
        "steady_step_s": _steady_step(lines, target),
        "first_step_s": round(firsts[1] - started, 2) if 1 in firsts else None,
        "between_steps_s": between_steps(lines),
    }



def fault_times(fault: dict, lines: list[dict], single_job: bool) -> dict[str, float | None]:
    """Resumed / rejoined / regained seconds of a fault injected from outside."""
    at, back = fault["wall"], fault.get("restarted_wall")
    step_then = max((line["step"] for line in lines if line["committed"] and line["wall"] <= at), default=0)

    def first(pred) -> float | None:
        hit = next((line["wall"] for line in lines if line["committed"] and pred(line)), None)
        return None if hit is None else round(hit - at, 2)

    def begun_after(line: dict, t: float | None) -> bool:
        return t is not None and line["wall"] - line["seconds"] >= t

    if single_job:
        resumed = first(lambda line: begun_after(line, back))
        rejoined = resumed
    else:
        resumed = first(lambda line: line["replica"] != fault["replica"] and begun_after(line, at))
        rejoined = first(lambda line: line["replica"] == fault["replica"] and begun_after(line, back))
    regained = first(lambda line: line["wall"] > at and line["step"] > step_then and begun_after(line, back or at))
    return {"detected_s": None, "resumed_s": resumed, "rejoined_s": rejoined, "regained_s": regained}


def by_kind(times: list[tuple[str, dict[str, float | None]]]) -> dict[str, dict[str, Any]]:
    """Per fault kind: count and the median and max of each time."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({kind for kind, _ in times}):
        rows = [t for k, t in times if k == kind]
        out[kind] = {"count": len(rows)}
        for name in ("detected_s", "resumed_s", "rejoined_s", "regained_s"):
            values = [row[name] for row in rows if row.get(name) is not None]
            out[kind][name] = {
                "median": round(statistics.median(values), 2) if values else None,
                "max": round(max(values), 2) if values else None,
            }
    return out


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def _loss_at(kept: list[dict], target: int) -> float | None:
    losses = [line["loss"] for line in kept if line["step"] == target and line["loss"] is not None]
    return round(sum(losses) / len(losses), 4) if losses else None


def _group_step(lines: list[dict]) -> float | None:
    return _over_groups(lines, lambda walls: statistics.median(b - a for a, b in zip(walls, walls[1:])))


def _steady_step(lines: list[dict], target: int) -> float | None:
    """The median over groups of each group's mean step over the run's second half."""
    return _over_groups(lines, lambda walls: (walls[-1] - walls[0]) / (len(walls) - 1), after_step=target // 2)


def _over_groups(lines: list[dict], per_group, after_step: int = 0) -> float | None:
    """The median over groups of `per_group` of each group's committed walls after `after_step`, in order."""
    values = []
    for replica in {line["replica"] for line in lines}:
        walls = sorted(line["wall"] for line in lines
                       if line["replica"] == replica and line["committed"] and line["step"] > after_step)
        if len(walls) > 1:
            values.append(per_group(walls))
    return round(statistics.median(values), 4) if values else None


def _median_gap(firsts: dict[int, float]) -> float | None:
    gaps = [firsts[s] - firsts[s - 1] for s in firsts if s - 1 in firsts]
    return round(statistics.median(gaps), 4) if gaps else None
