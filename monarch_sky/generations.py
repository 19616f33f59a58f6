"""A replica group's generations on its host: spawn, warm standby, discard, abandon.

Generation g of replica r is a process mesh named `r{r}g{g}`. A new generation is spawned
(processes up, torch and torchtitan imported) ahead of need as a warm standby, so a
recovery only builds the trainer. A generation that failed on a live host is discarded
(its processes stopped); one on a dead host is abandoned (stopping it there would hang),
and the slot's generations move to a replacement host from the provider.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from monarch_sky.context import RunContext, off_loop
from monarch_sky.hosts import Host, HostError
from monarch_sky.replica import ReplicaGroup
from monarch_sky.supervision import describe_error, resolved


class Generations:
    def __init__(self, ctx: RunContext, index: int, host: Host, host_mesh: Any):
        self.ctx = ctx
        self.index = index
        self.host = host
        self.host_mesh = host_mesh
        self.spawned = 0  # generations spawned so far (standbys included)
        self.standby: asyncio.Task | None = None  # resolves to a warmed next generation

    async def move_to_new_host(self) -> None:
        """Ask the provider for a host to replace the lost one and attach to it; raises
        HostError when none comes within `hosts.provision_timeout_s` (or the provider fails)."""
        ctx, lost, index = self.ctx, self.host, self.index
        timeout_s = ctx.cfg.hosts.provision_timeout_s
        ctx.record.event("host_lost", replica=index, host=lost.address)
        ctx.display.line(f"[replica {index}] host {lost.name} ({lost.address}) is gone; asking for a replacement")
        began = time.monotonic()
        try:
            host = await asyncio.wait_for(off_loop(ctx.provider.replace, lost), timeout_s)
            mesh = await attach_host(ctx, host)
        except Exception as e:
            reason = f"no replacement host within {timeout_s:g}s" if isinstance(e, asyncio.TimeoutError) else describe_error(e)
            ctx.record.event("host_replacement_failed", replica=index, reason=reason)
            raise HostError(f"host {lost.name} was lost and no replacement came: {reason}") from None
        self.host, self.host_mesh = host, mesh
        seconds = round(time.monotonic() - began, 3)
        ctx.record.event("host_replaced", replica=index, host=host.address, seconds=seconds)
        ctx.display.line(f"[replica {index}] replacement host {host.name} ({host.address}) attached after {seconds:.1f}s")

    async def spawn(self) -> ReplicaGroup:
        """A new generation with processes up and code imported."""
        ctx = self.ctx
        group = ReplicaGroup(self.index, self.spawned, self.host, self.host_mesh, ctx.cfg.procs_per_replica)
        self.spawned += 1
        ctx.groups[group.owner] = group
        ctx.router.watch(group.owner)
        try:
            await group.spawn(ctx.spec(self.index), ctx.proc_env(self.host), ctx.cfg.timeouts.spawn_s)
        except BaseException:
            await self.discard(group)
            raise
        return group

    def forget(self, group: ReplicaGroup) -> None:
        """No more failures, shutdown or standby duty for this generation."""
        self.ctx.router.unwatch(group.owner)
        self.ctx.groups.pop(group.owner, None)

    async def discard(self, group: ReplicaGroup) -> None:
        self.forget(group)
        await group.stop(self.ctx.cfg.timeouts.stop_s)

    def abandon(self, group: ReplicaGroup) -> None:
        """Forget a group on a dead host: stopping a mesh there would hang."""
        self.forget(group)
        group.proc_mesh = None

    def abandon_standby(self) -> None:
        """The standby shared the dead host: drop it without waiting on that host."""
        task, self.standby = self.standby, None
        if task is None:
            return
        if task.done() and not task.cancelled() and task.exception() is None:
            self.abandon(task.result())
        else:
            task.cancel()  # its cleanup waits on the dead host, bounded by timeouts.stop_s
            self.ctx.background.add(task)

    def refill_standby(self) -> None:
        if self.ctx.cfg.ft.standby and not self.ctx.finishing and self.standby is None:
            self.standby = asyncio.ensure_future(self.spawn())

    async def take(self) -> tuple[ReplicaGroup, bool]:
        """The warm standby if it is alive, else a freshly spawned generation."""
        task, self.standby = self.standby, None
        if task is not None:
            try:
                group = await task
            except Exception:  # a broken standby: spawn cold
                group = None
            if group is not None and group.failure is None:
                return group, True
            if group is not None:
                await self.discard(group)
        return await self.spawn(), False

    async def close_standby(self) -> None:
        task, self.standby = self.standby, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def attach_host(ctx: RunContext, host: Host):
    """Each host is its own HostMesh: a dead host never blocks the others' meshes."""
    from monarch.actor import attach_to_workers

    mesh = attach_to_workers(name=f"host-{host.name}", ca="trust_all_connections", workers=[host.address])
    await asyncio.wait_for(resolved(mesh.initialized), ctx.cfg.timeouts.spawn_s)
    return mesh
