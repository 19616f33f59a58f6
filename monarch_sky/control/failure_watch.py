"""The controller's watch over the training groups, beside Monarch supervision (which reports on
its own): twice a second, each group's hosts are probed (`detection.probe_hosts`), its host agent
is asked whether any of its processes exited, and a step out for far longer than usual is checked
for a hang (a live trainer answers a ping even mid-step). What it finds goes to the slot
(`Slot.on_failure`), like every other detector's word.
"""

from __future__ import annotations

import asyncio
import time

from monarch_sky.control.context import RunContext
from monarch_sky.control.detection import HostWatchdog, exited_on_hosts, probe_hosts
from monarch_sky.hosts.base import UP

DETECT_EVERY_S = 0.5
HANG_FACTOR = 5  # a step this many times the recent median is suspected of hanging


class FailureWatch:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.watchdog = HostWatchdog.of(ctx.cfg.hosts)
        self._pinging: set = set()  # groups whose hang check is running

    async def run(self) -> None:
        """Ask the hosts every half second; Monarch supervision reports on its own."""
        ctx = self.ctx
        while True:
            await asyncio.sleep(DETECT_EVERY_S)
            watched = [s for s in self.ctx.slots if s.group is not None and s.group.failure is None]
            await asyncio.gather(*(self._check(s) for s in watched), ctx.spares.check(), return_exceptions=True)

    async def _check(self, slot) -> None:
        group, hosts = slot.group, slot.hosts
        dead, probes = await probe_hosts(self.ctx.provider, hosts, self.watchdog, DETECT_EVERY_S * 2)
        if dead is not None:
            self.watchdog.forget(dead.address)
            slot.on_failure(group, f"host {dead.name} ({dead.address}) is unreachable", time.monotonic())
            return
        reachable = all(p == UP for p in probes)
        if reachable and self._suspect_hang(slot):
            self.ctx.in_background(self._check_hang(slot, group))
        if reachable and slot.agent is not None and group.pids:
            try:
                exited = await exited_on_hosts(slot.agent, group.pids, 2 * DETECT_EVERY_S)
            except Exception:  # a slow or restarting agent says nothing either way
                return
            if exited and slot.group is group:
                slot.on_failure(group, f"process {exited[0]} exited (seen by its host)", time.monotonic())

    def _suspect_hang(self, slot) -> bool:
        """A step out for several times the recent median (and at least timeouts.hang_s)."""
        since, hang_s = slot.in_flight_since, self.ctx.cfg.timeouts.hang_s
        if since is None or slot.group in self._pinging:
            return False
        return time.monotonic() - since > max(HANG_FACTOR * self.ctx.ledger.median_step_s(), hang_s)

    async def _check_hang(self, slot, group) -> None:
        """Confirm a suspected hang: a live trainer answers a ping even mid-step."""
        self._pinging.add(group)
        try:
            hang_s = self.ctx.cfg.timeouts.hang_s
            if not await group.answers(hang_s) and slot.group is group and slot.in_flight_since is not None:
                slot.on_failure(group, f"hung: a trainer answered nothing for {hang_s:g}s during a step", time.monotonic())
        finally:
            self._pinging.discard(group)
