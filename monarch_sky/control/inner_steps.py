"""DiLoCo's inner steps in one call (issue 48: the controller's share of a step).

Between two syncs a DiLoCo group trains alone: nothing the controller does between its inner
steps changes them. One call per step cost the controller and the host workers ~9 ms of CPU
per group step (0.28 s against TorchFT alone's 0.25 s, 3 groups on 2 cores), so a group runs
the inner steps before the next sync in one call and hands back every step's result, which
the slot takes in order, as if each had come alone. The sync itself stays a call of its own:
a rejoining group waits for the others' step before a sync to join them (`rejoin.wait_for_next_sync`),
and the commit, heal and checkpoint of a sync are the slot's per-step path.

Only while nothing needs a step to be its own call: every group trains (none is starting,
recovering or rejoining), no fault is scheduled (they aim at steps) and chaos is off. A group
that dies in the middle of a batch fails the call, as it fails a step.
"""

from __future__ import annotations

import asyncio
import time

from monarch_sky.control.slot_state import SlotState

SETTLED = (SlotState.TRAINING, SlotState.DONE, SlotState.LOST)


def batch(ctx, slot) -> int:
    """How many steps `slot`'s next call may run: the inner steps left before the next sync
    when nothing needs each step apart, else 1."""
    cfg = ctx.cfg
    if cfg.ft.mode != "diloco" or slot.state is not SlotState.TRAINING or ctx.finishing:
        return 1
    if ctx.injector.pending or cfg.chaos.every_s or any(s.state not in SETTLED for s in ctx.slots):
        return 1
    every = cfg.ft.sync_steps
    return max(1, min(every - 1 - slot.step % every, cfg.steps - slot.step))


async def run(slot, count: int) -> None:
    """`count` inner steps of `slot`'s group in one call; each result is taken in order, at
    about the time it ended: the call's time shared out in proportion to the steps' seconds."""
    ctx, issued = slot.ctx, time.monotonic()
    slot.step_calls += 1
    results = await slot._timed(asyncio.ensure_future(slot.group.inner_steps(count, ctx.cfg.timeouts.step_s)), issued)
    took, total, done = time.monotonic() - issued, sum(r.seconds for r in results) or 1.0, 0.0
    for r in results:
        done += r.seconds
        await slot.on_result(r, issued, issued + took * done / total)
        await ctx.checkpoints.after_step(slot, r)
        if slot.state is not SlotState.TRAINING:
            return
