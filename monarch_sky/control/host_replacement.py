"""A replica group's lost hosts: fenced, then replaced by a spare or the provider's new host.

Each lost host has one replacement request, kept across tries; hosts a given-up group no longer
needs go back to the provider as spares. `Generations` (`generations.py`) mixes this in: a new
HostMesh over the kept and the new hosts carries the group's next generation.
"""

from __future__ import annotations

import asyncio
import time

from monarch_sky.common.supervision import describe_error, resolved
from monarch_sky.control.context import RunContext, off_loop
from monarch_sky.control.detection import kill_on_hosts
from monarch_sky.hosts.base import Host, HostError

PROBE_EVERY_S = 0.5  # how often a group's hosts are probed while a generation is built
PROBE_TIMEOUT_S = 2.0  # one look at whether a host is up


class HostReplacement:
    async def replace_hosts(self, lost: list[Host]) -> None:
        """Put a host in place of each lost one: a spare from the pool (`hosts.spares`) if one
        is ready, else the provider's; then one mesh over the group's hosts, the kept ones too.
        Raises HostError when they do not all come within `hosts.provision_timeout_s` (or the
        provider fails). A host that came is kept for the next try (`orders`), so a retry
        never asks for a second one."""
        ctx, index = self.ctx, self.index
        timeout_s = ctx.cfg.hosts.provision_timeout_s
        for host in lost:
            if host in self.orders:
                ctx.display.line(f"[replica {index}] still waiting for a host in place of {host.name}")
                continue
            ctx.record.event("host_lost", replica=index, host=host.address)
            ctx.display.line(f"[replica {index}] host {host.name} ({host.address}) is gone; asking for a replacement")
        began = time.monotonic()
        spares = await self._take_spares(lost)
        ordered = [h for h in lost if h not in spares]
        try:
            orders = [await self._order(h) for h in ordered]
            # shield: a request that outlasts this wait stays ordered for the next try
            came = await asyncio.wait_for(asyncio.shield(_gathered(orders)), timeout_s) if orders else []
            new = {**dict(zip(ordered, came)), **{h: s.host for h, s in spares.items()}}
            hosts = [new.get(h, h) for h in self.hosts]
            warm = next(iter(spares.values())) if len(hosts) == 1 and spares else None
            mesh = warm.mesh if warm is not None else await attach_hosts(ctx, hosts)
        except Exception as e:
            for spare in spares.values():  # the next try's order gets it first
                ctx.provider.give_back(spare.host)
            reason = f"no replacement host within {timeout_s:g}s" if isinstance(e, asyncio.TimeoutError) else describe_error(e)
            ctx.record.event("host_replacement_failed", replica=index, reason=reason)
            names = ", ".join(h.name for h in lost)
            raise HostError(f"host {names} was lost and no replacement came: {reason}") from None
        for host in ordered:
            self.orders.pop(host, None)
        self.hosts, self.host_mesh, self.agent = hosts, mesh, None
        if warm is not None and warm.group is not None:
            self._adopt(warm.group)
        self.ctx.in_background(self.start_agent())
        self._say_replaced(lost, new, spares, round(time.monotonic() - began, 3))

    async def _take_spares(self, lost: list[Host]) -> dict:
        """A spare (`monarch_sky.control.spares.Spare`) for each lost host the pool can cover: a ready
        one, else one still warming, waited for."""
        spares, pool = {}, self.ctx.spares
        for host in lost:
            if host in self.orders:
                continue
            spare = await pool.take(host) or await pool.wait_for_warming(host, self.index)
            if spare is not None:
                spares[host] = spare
        return spares

    def _say_replaced(self, lost: list[Host], new: dict, spares: dict, seconds: float) -> None:
        now = time.monotonic()
        for old in lost:
            host, spare = new[old], spares.get(old)
            age = {"spare": True, "spare_age_s": spare.age_s(now), "warm": spare.group is not None} if spare else {"spare": False}
            self.ctx.record.event("host_replaced", replica=self.index, host=host.address, seconds=seconds, **age)
            self.ctx.injector.host_replaced(self.index, {"host": host.address, "seconds": seconds, **age})
            source = "spare host" if spare else "replacement host"
            self.ctx.display.line(f"[replica {self.index}] {source} {host.name} ({host.address}) attached after {seconds:.1f}s")

    async def _order(self, lost: Host) -> asyncio.Future:
        """The request for a host in place of `lost`: the one already out, unless it failed
        or brought a host that died since; then the spare pool's refill in flight, if it has
        one (it was ordered earlier), else a new one."""
        task = self.orders.get(lost)
        if task is not None and task.done():
            failed = task.cancelled() or task.exception() is not None
            if failed or not await self.ctx.provider.probe(task.result(), PROBE_TIMEOUT_S):
                task = None
        if task is None and (task := self.ctx.spares.claim_refill(lost)) is not None:
            self.ctx.record.event("spare_refill_claimed", replica=self.index, instead_of=lost.address)
        if task is None:
            task = asyncio.ensure_future(off_loop(self.ctx.provider.replace, lost))
        if self.orders.get(lost) is not task:
            self.orders[lost] = task
            self.ctx.keep(task)  # cancelled at shutdown; a late host is given back below
        return task

    def give_back_hosts(self) -> None:
        """The group is given up: every host ordered for it, now or when it comes, goes back to
        the provider as a spare instead of idling, billed, until the run ends."""
        orders, self.orders = list(self.orders.values()), {}
        for task in orders:
            task.add_done_callback(self._give_back)

    def _give_back(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            self.ctx.provider.give_back(task.result())
            self.ctx.record.event("host_given_back", replica=self.index, host=task.result().address)

    async def fence_lost(self, lost: list[Host]) -> None:
        """Cut off the group's dead hosts, and the standby that shared them."""
        standby = self.abandon_standby()
        if standby is not None and self.agent is not None:  # its processes on the kept hosts
            kill_on_hosts(self.agent, standby.pids, skip=tuple(self.hosts.index(h) for h in lost))
        for host in lost:
            await self.fence(host)

    async def move_off_dead_hosts(self) -> str | None:
        """After a failed start: fence and replace whichever of the group's hosts died; returns
        why a replacement failed (the next try's build then fails at the dead host)."""
        lost = await self.lost_hosts()
        if not lost:
            return None
        await self.fence_lost(lost)
        try:
            await self.replace_hosts(lost)
        except HostError as e:
            return describe_error(e)
        return None

    async def lost_hosts(self) -> list[Host]:
        """The group's hosts whose workers no longer answer."""
        alive = await asyncio.gather(*(self.ctx.provider.probe(h, PROBE_TIMEOUT_S) for h in self.hosts))
        return [h for h, up in zip(self.hosts, alive) if not up]

    async def fence(self, host: Host) -> None:
        """A host declared dead may only be cut off (a partition): make sure its processes
        stop where the provider can reach them. Its replacement gets new TorchFT replica ids
        (each manager adds a fresh uuid), so old processes can never pose as the new group;
        a provider that cannot stop hosts (fixed addresses, SkyPilot) retires it instead (a
        replacement cluster goes down), and fails nothing."""
        if not self.ctx.provider.can_stop_hosts:
            self.ctx.provider.retire(host)
            return
        await self.ctx.provider_call(self.ctx.provider.kill, host, what=f"fencing lost host {host.name}")


async def attach_hosts(ctx: RunContext, hosts: list[Host]):
    """One replica group's hosts as one HostMesh (its own: a dead host never blocks the other
    groups' meshes). A worker may be in several meshes: after a host is replaced, a new mesh
    covers the kept hosts and the new one."""
    from monarch.actor import attach_to_workers

    name = "host-" + "+".join(h.name for h in hosts)
    mesh = attach_to_workers(name=name, ca="trust_all_connections", workers=[h.address for h in hosts])
    await asyncio.wait_for(resolved(mesh.initialized), ctx.cfg.timeouts.spawn_s)
    return mesh


def _gathered(orders: list) -> asyncio.Future:
    """The orders as one future, whose outcome counts as seen: orders still out when the
    run ends are cancelled, and asyncio would log that nobody read it."""
    together = asyncio.gather(*orders)
    together.add_done_callback(lambda f: f.cancelled() or f.exception())
    return together
