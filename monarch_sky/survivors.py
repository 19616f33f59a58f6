"""Survivors stuck with a dead peer: abort their collectives instead of waiting them out.

When a group dies mid-step, a survivor's collective with it usually fails at once (the
sockets close). Not always: a rank whose ring neighbour is still alive, or a socket that
never sees the reset, waits out `ft.process_group_timeout_ms` (seen: a survivor's step took
5.4 s after a segfault, the others' failed within 0.7 s). The controller knows of the death
first, so for a while after it, any survivor whose step began before the detection and
runs well past the recent median has its collectives aborted: TorchFT fails that step and
reconfigures at the next quorum, as after a `comms` fault. A step that merely runs long loses
nothing it would have kept: it began with the dead group in its quorum.
"""

from __future__ import annotations

import asyncio
import time

from monarch_sky.context import RunContext

STUCK_FACTOR = 3.0  # a step out this many times the median (and 0.2 s more) is stuck: a slow
# step on a loaded machine is not (aborting it would cost a step), a dead collective is


async def unstick(ctx: RunContext, failed, detected_at: float) -> None:
    """Watch the other training slots until their steps from before `detected_at` ended."""
    from monarch_sky.slot import SlotState

    deadline = detected_at + ctx.cfg.ft.process_group_timeout_ms / 1000
    aborted: set[int] = set()
    while time.monotonic() < deadline and not ctx.finishing:
        doomed = [
            s for s in ctx.slots
            if s is not failed and s.state is SlotState.TRAINING and s.group is not None
            and s.in_flight_since is not None and s.in_flight_since < detected_at
        ]
        if not doomed:
            return
        limit = STUCK_FACTOR * ctx.ledger.median_step_s() + 0.2
        for slot in doomed:
            out = time.monotonic() - slot.in_flight_since
            if slot.index not in aborted and out > limit:
                aborted.add(slot.index)
                slot.group.abort_collectives()
                ctx.record.event("collectives_aborted", replica=slot.index, step_out_s=round(out, 3),
                                 failed_replica=failed.index)
        await asyncio.sleep(0.05)
