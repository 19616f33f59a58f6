"""Two questions about a new generation rejoining the run, asked by its slot.

- Per-step mode: when to build it? Only once the survivors have committed without every
  group that failed so far (see `wait_for_survivors_commit`).
- DiLoCo: when to join? A new generation heals only at a sync, so it waits until another
  group's next step is a sync, then joins that quorum without training first. Asking
  earlier would wait in the lighthouse past TorchFT's quorum timeout, or take a quorum
  without a survivor that comes later.
- Did it recover anything? A commit far behind the run is no rejoin: while a group that
  holds the state trains, the newcomer heals from it later; if none does, the state is lost.
- Lost state: a new generation with no one to heal from loads the newest state its hosts hold
  in node memory, or the newest complete checkpoint if that is newer. One that already trained
  from scratch heals from a group that is coming back to load it, or, with none coming, is
  rebuilt to load it itself. With neither, training starts over. Each is reported as lost
  progress, never as a recovery.
"""

from __future__ import annotations

import asyncio
import enum
import time

from monarch_sky.control.checkpoint_resume import data_states
from monarch_sky.control.context import RunContext
from monarch_sky.control.memory_point import MemoryPoint
from monarch_sky.replica.data_position import DataHandover
from monarch_sky.control.slot_state import SlotState
from monarch_sky.replica.step_result import StepResult


async def wait_for_next_sync(ctx: RunContext, slot) -> bool:
    """Wait until another training group's next step is a sync (or none trains); False if
    the run is finishing. Bounded by one sync interval of step timeouts."""
    every = ctx.cfg.ft.sync_steps
    deadline = time.monotonic() + every * ctx.cfg.timeouts.step_s
    while not ctx.finishing and time.monotonic() < deadline:
        others = [s for s in ctx.slots if s is not slot and s.state is SlotState.TRAINING]
        if not others or any(s.step % every == every - 1 for s in others):
            break
        await asyncio.sleep(0.02)
    return not ctx.finishing


async def wait_for_survivors_commit(ctx: RunContext, slot) -> None:
    """Wait until another group commits a step issued after the latest failure of any
    group (bounded from that failure).

    A new generation's TorchFT manager heartbeats from the moment it is built, and the
    lighthouse holds back a quorum for every heartbeating group: built at once, it makes
    the survivors wait until it has built and reached its first step (with three groups and
    one survivor, the lighthouse's majority rule forms no quorum at all without it). Built
    after their first commit, it joins their next quorum and heals there. The gate is the
    latest failure of any group, not only this slot's: two recoveries that overlap would
    otherwise build while the other's survivors still regroup. DiLoCo groups commit
    locally between syncs and never wait for it.
    """
    if ctx.cfg.ft.mode == "diloco":
        return
    began = time.monotonic()
    bound = ctx.cfg.ft.heartbeat_timeout_ms / 1000 + 3 * ctx.ledger.median_step_s() + 1.0
    while time.monotonic() - max(began, ctx.last_failure_at) < bound and not ctx.finishing:
        others = [s for s in ctx.slots if s is not slot and s.state is SlotState.TRAINING]
        if not others or any(s.last_commit_issued > ctx.last_failure_at for s in others):
            return
        await asyncio.sleep(0.02)
    ctx.record.event("survivors_not_committed", replica=slot.index, waited_s=round(time.monotonic() - began, 3))


def trained_unreported(ctx: RunContext, slot, member: str) -> int:
    """Steps that the slot's failed generation trained but never reported: those up to the
    commit after its last answer, if the others made that commit in a quorum that counted it.

    A group that dies after its step's commit and before its answer comes back has its
    gradient in everyone's weights, so that step's batches were trained. The others' commit
    is the truth: a group that died before its gradient was all-reduced breaks their
    all-reduce, and they commit that step again without it. DiLoCo keeps a group's data
    position at its syncs: a sync that counted it took its whole interval's pseudo-gradient,
    so the interval's batches were trained. `member` is the failed generation's quorum id;
    asked after `wait_for_survivors_commit`, so the others' commit is in.
    """
    interval = commit_slack(ctx)  # 1 step, or DiLoCo's sync interval
    unreported = (slot.step // interval + 1) * interval
    if not member or member not in ctx.ledger.quorums.get(unreported, ()):
        return 0
    ctx.record.event("trained_unreported", replica=slot.index, step=unreported)
    return interval


class Behind(enum.Enum):
    NO = "no"  # it committed at the run's step: a real rejoin
    CATCHING_UP = "catching up"  # behind, but a group holding the state trains: it heals later
    STATE_LOST = "state lost"  # behind, and nobody holds the state any more


def commit_slack(ctx: RunContext) -> int:
    """How far behind the run's step a commit may be and still be at it (DiLoCo: a sync interval)."""
    return ctx.cfg.ft.sync_steps if ctx.cfg.ft.mode == "diloco" else 1


def holders(ctx: RunContext, slot) -> list:
    """The other groups holding the run's training state: training at the run's step, a new
    generation that healed at it (its step may not have committed: the holder it healed from
    died in that step), or one loaded from the checkpoint the run went back to."""
    oldest = ctx.ledger.run_step - commit_slack(ctx)

    def holds(s) -> bool:
        if s.state is SlotState.REJOINING and s.loaded_step is not None:
            return True
        trains = s.state in (SlotState.TRAINING, SlotState.DONE) or s.state is SlotState.REJOINING and s.heal is not None
        return trains and s.step >= oldest

    return [s for s in ctx.slots if s is not slot and holds(s)]


def behind(ctx: RunContext, slot, r: StepResult) -> Behind:
    """Whether a rejoining group's cross-group commit is at the run's step.

    A commit far behind means its quorum had no group holding the state: two fresh groups
    can commit a step together while the holder's heartbeat is late (seen on a loaded
    2-core machine). If a holder still trains, the next quorum heals the newcomer from it;
    if none does, the state is lost (`checkpoint_to_reload`, `note_progress_lost`).
    """
    slack = commit_slack(ctx)
    if r.step >= ctx.ledger.run_step - slack or slot.loaded_step is not None:
        return Behind.NO
    return Behind.CATCHING_UP if holders(ctx, slot) else Behind.STATE_LOST


def another_coming_back(ctx: RunContext, slot) -> bool:
    """Another group is recovering: with no holder left it loads the checkpoint, and then
    `slot`'s generation heals from it (no need to rebuild this one to load it too)."""
    return any(s is not slot and s.state is SlotState.RECOVERING for s in ctx.slots)


async def state_to_reload(ctx: RunContext, slot):
    """What a new generation of `slot` loads instead of healing: the newest state its hosts hold
    in node memory (a `memory_restore.MemoryPoint`) or the newest complete checkpoint (a
    `checkpoints.Found`), whichever is newer; None when another group holds the training state
    (the usual case: it heals from that one) or there is neither.

    Only when every holder failed at once: healing from a fresh peer would start training over.
    """
    if holders(ctx, slot) or ctx.ledger.run_step == 0:
        return None
    memory, found = await ctx.memory.held_by(slot), await ctx.checkpoints.newest()
    if memory is not None and (found is None or memory.step >= found.step):
        return memory
    return found


def note_progress_lost(ctx: RunContext, slot, restarted_at: int, found=None) -> None:
    """Every group holding the state failed: training goes on from `restarted_at`, the step of
    `found` (the state in node memory or a checkpoint: its steps after it are trained again)
    or, with none, from scratch.
    Recorded once per loss: by the first group to go back (a group that loaded the same
    checkpoint a moment later finds that one holding the state)."""
    at = ctx.ledger.run_step
    if at <= restarted_at or holders(ctx, slot) or any(p["at_step"] == at for p in ctx.progress_lost):
        return
    memory = isinstance(found, MemoryPoint)
    lost = {"replica": slot.index, "at_step": at, "restarted_at_step": restarted_at,
            "from_checkpoint": str(found.path) if found is not None and not memory else None,
            "from_memory": list(found.hosts) if memory else None}
    ctx.progress_lost.append(lost)
    ctx.record.event("progress_lost", **lost)
    ctx.ledger.rewind(restarted_at)
    if found is not None:
        what = "the state its hosts held in node memory" if memory else "the checkpoint"
        went = f"loaded {what} at step {found.step}: {at - found.step} steps are trained again"
    else:
        went = f"training restarts at step {restarted_at}, {ctx.checkpoints.none_to_reload()}"
        for other in ctx.slots:  # those still coming back heal from one that started over: no recovery
            other.started_over = other is not slot and not other.active
    ctx.display.line(f"[run] every group holding the training state failed at step {at}; {went}")


def resume_from(ctx: RunContext, slot, found) -> None:
    """Slot's new generation loaded `found` (node memory or a checkpoint): its step and data
    position are those of `found`."""
    note_progress_lost(ctx, slot, found.step, found)
    slot.loaded_step, slot.loaded_from = found.step, "memory" if isinstance(found, MemoryPoint) else "checkpoint"
    slot.step = found.step
    if isinstance(found, MemoryPoint):
        slot.data_states, slot.skip_steps = found.data_states.get(slot.index, ()), found.skip_steps.get(slot.index, 0)
    else:
        slot.data_states, slot.skip_steps = data_states(found, slot.index), 0


def what_it_loads(ctx: RunContext, slot, rejoining: bool, resume):
    """(the checkpoint a new generation of `slot` loads, the node memory it loads instead):
    `resume` if given, else the first generation's of a run that goes on from memory or a
    checkpoint (none for a generation that heals)."""
    if isinstance(resume, MemoryPoint):
        return None, resume
    if resume is not None or rejoining:
        return resume, None
    point = ctx.memory.point if slot.state is SlotState.STARTING else None
    if point is not None and slot.index in point.loaders:
        return None, point
    return ctx.checkpoints.resume, None  # a restarted run's, if any


def data_handover(slot, rejoining: bool, memory: MemoryPoint | None) -> DataHandover:
    """Where a new generation reads on: node memory's position at its step, the slot's own (a
    rejoin), or, loading a checkpoint or starting afresh, none given (the checkpoint has it)."""
    if memory is not None:
        return DataHandover(memory.data_states.get(slot.index, ()), memory.skip_steps.get(slot.index, 0))
    return DataHandover(slot.data_states, slot.skip_steps) if rejoining else DataHandover()
