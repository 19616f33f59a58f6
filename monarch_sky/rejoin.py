"""Two questions about a new generation rejoining the run, asked by its slot.

- Per-step mode: when to build it? Only once the survivors have committed without every
  group that failed so far (see `wait_for_survivors_commit`).
- DiLoCo: when to join? A new generation heals only at a sync, so it waits until another
  group's next step is a sync, then joins that quorum without training first. Asking
  earlier would wait in the lighthouse past TorchFT's quorum timeout, or take a quorum
  without a survivor that comes later.
- Did it recover anything? A commit far behind the run is no rejoin: while a group that
  holds the state trains, the newcomer heals from it later; if none does, training has
  started over, which is reported as lost progress, never as a recovery.
"""

from __future__ import annotations

import asyncio
import enum
import time

from monarch_sky.context import RunContext
from monarch_sky.step_result import StepResult


async def wait_for_next_sync(ctx: RunContext, slot) -> bool:
    """Wait until another training group's next step is a sync (or none trains); False if
    the run is finishing. Bounded by one sync interval of step timeouts."""
    from monarch_sky.slot import SlotState

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
    from monarch_sky.slot import SlotState

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
    """Steps that the slot's failed generation trained but never reported: 1 if the others
    committed the step after its last answer in a quorum that counted it, else 0.

    A group that dies after its step's commit and before its answer comes back has its
    gradient in everyone's weights, so that step's batches were trained. The others' commit
    is the truth: a group that died before its gradient was all-reduced breaks their
    all-reduce, and they commit that step again without it. `member` is the failed
    generation's quorum id; asked after `wait_for_survivors_commit`, so the others' commit
    is in. DiLoCo keeps a group's data position at its syncs: not handled here.
    """
    if ctx.cfg.ft.mode == "diloco" or not member or member not in ctx.ledger.quorums.get(slot.step + 1, ()):
        return 0
    ctx.record.event("trained_unreported", replica=slot.index, step=slot.step + 1)
    return 1


class Behind(enum.Enum):
    NO = "no"  # it committed at the run's step: a real rejoin
    CATCHING_UP = "catching up"  # behind, but a group holding the state trains: it heals later
    STATE_LOST = "state lost"  # behind, and nobody holds the state any more


def behind(ctx: RunContext, slot, r: StepResult) -> Behind:
    """Whether a rejoining group's cross-group commit is at the run's step.

    A commit far behind means its quorum had no group holding the state: two fresh groups
    can commit a step together while the holder's heartbeat is late (seen on a loaded
    2-core machine). If a holder still trains, the next quorum heals the newcomer from it;
    if none does, training has started over: reported as lost progress, never a recovery.
    """
    from monarch_sky.slot import SlotState

    slack = ctx.cfg.ft.sync_steps if ctx.cfg.ft.mode == "diloco" else 1
    if r.step >= ctx.ledger.run_step - slack:
        return Behind.NO
    holders = [
        s for s in ctx.slots
        if s is not slot and s.state in (SlotState.TRAINING, SlotState.DONE) and s.step >= ctx.ledger.run_step - slack
    ]
    if holders:
        return Behind.CATCHING_UP
    lost = {"replica": slot.index, "at_step": ctx.ledger.run_step, "restarted_at_step": r.step}
    if not any(p["at_step"] == lost["at_step"] for p in ctx.progress_lost):
        ctx.progress_lost.append(lost)
        ctx.record.event("progress_lost", **lost)
        ctx.display.line(
            f"[run] every group holding the state failed: training restarts at step {r.step} "
            f"(was {ctx.ledger.run_step}); {ctx.checkpoints.after_progress_lost()}"
        )
    return Behind.STATE_LOST
