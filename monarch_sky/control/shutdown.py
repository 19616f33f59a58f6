"""Stopping a run: everything it started, in order, within timeouts.stop_s, and what did not stop.

The order: background tasks and standbys, the replica groups, the run's node memory (given
back), the hosts' workers (the groups' and the spares'), then the provider takes its hosts back
and the lighthouse stops. Before the
provider does (it kills whatever runs on the hosts it started), the run's processes still alive
on this machine other than those hosts' workers are listed: a trainer the orderly stop missed
would stay up on a real node, holding its accelerator's memory. The summary's `left_running`
names them, so a test can fail on one; the provider and the final reap then kill them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from monarch_sky.control.context import RunContext, off_loop
from monarch_sky.hosts.local import run_processes

log = logging.getLogger(__name__)

EXIT_GRACE_S = 5.0  # how long the run's processes get to exit after their hosts were told to stop


async def stop_everything(ctx: RunContext, slots: list, lighthouse, forget_memory: bool = True,
                          release_hosts: bool = True) -> list[str]:
    """Stop what the run started; returns the processes the orderly stop left running.
    `forget_memory`: give the run's node memory back (not after a controller's failure,
    which a run again under its id goes on from). `release_hosts`: tell the hosts' workers the
    run is over (not when a newer controller of the run drives them)."""
    ctx.finishing = True
    deadline = time.monotonic() + ctx.cfg.timeouts.stop_s
    for task in list(ctx.background):
        task.cancel()
    stop_s = ctx.cfg.timeouts.stop_s
    await _within(ctx, deadline, "standbys", asyncio.gather(
        *(s.gens.close_standby() for s in slots), *ctx.background, return_exceptions=True))
    await _within(ctx, deadline, "replica groups", asyncio.gather(
        *(g.close(stop_s) for g in list(ctx.groups.values())), return_exceptions=True))
    if forget_memory and ctx.memory is not None:  # once no trainer writes to it any more
        await _within(ctx, deadline, "node memory", ctx.memory.forget())
    if release_hosts:
        await _within(ctx, deadline, "hosts", asyncio.gather(
            *(s.gens.release() for s in slots), ctx.spares.release(), return_exceptions=True))
    if ctx.router is not None:
        ctx.router.uninstall()
    left = await off_loop(left_running, ctx.cfg.run_id, ctx.provider.host_pids(), EXIT_GRACE_S)
    if left:
        ctx.record.event("left_running", processes=left)
        ctx.display.line(f"monarch-sky: {len(left)} processes of the run outlived its stop; killing them: {left}")
    try:  # the provider gets its own budget even when the stages above used up the time
        await asyncio.wait_for(off_loop(ctx.provider.shutdown), max(deadline - time.monotonic(), ctx.provider.release_s))
    except Exception as e:
        reason = "did not finish in time" if isinstance(e, asyncio.TimeoutError) else str(e)
        ctx.record.event("provider_error", action="shutdown", error=reason)
        ctx.display.line(f"monarch-sky: releasing the hosts: {reason}")
    if lighthouse is not None:
        lighthouse.shutdown()
    return left


def left_running(run_id: str, hosts: set[int], grace_s: float) -> list[str]:
    """The run's processes on this machine, other than the controller and the host workers
    in `hosts`, still alive after `grace_s`: "pid: command line" each."""
    import psutil

    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for proc in run_processes(run_id):
            try:
                if proc.pid in hosts or proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                alive.append(f"{proc.pid}: {' '.join(proc.cmdline())[:160]}")
            except psutil.Error:
                continue
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.25)


async def _within(ctx: RunContext, deadline: float, what: str, awaitable) -> None:
    began = time.monotonic()
    try:
        await asyncio.wait_for(awaitable, max(deadline - time.monotonic(), 0.5))
        log.info("stopped the %s in %.2fs", what, time.monotonic() - began)
    except asyncio.TimeoutError:
        ctx.record.event("shutdown_stage_timed_out", stage=what)
        log.warning("stopping the %s took longer than timeouts.stop_s; moving on", what)
