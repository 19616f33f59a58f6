"""A replica group's generations on its hosts: spawn, warm standby, discard, abandon.

Generation g of replica r is a process mesh named `r{r}g{g}` over the group's hosts
(`hosts_per_replica` of them, one HostMesh). A new generation is spawned (processes up,
torch and torchtitan imported) ahead of need as a warm standby, so a recovery only builds
the trainer. A generation that failed on live hosts is discarded (its processes stopped);
one with a dead host is abandoned (stopping it there would hang), each dead host is
replaced by the provider, and a new HostMesh covers the kept and the new hosts.

A build watches the group's hosts, so a host that dies under it ends it at once. Replacing a
lost host is the other half (`host_replacement.py`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from monarch_sky.common.supervision import describe_error, resolved
from monarch_sky.control.context import RunContext
from monarch_sky.control.detection import HostWatchdog, kill_on_hosts, start_host_agent, unless_a_host_dies
from monarch_sky.control.host_replacement import PROBE_EVERY_S, HostReplacement, attach_hosts
from monarch_sky.hosts.base import Host, HostError
from monarch_sky.replica.actor import ReplicaGroup
from monarch_sky.replica.data_position import DataHandover

AGENT_TRIES = 3


class Generations(HostReplacement):
    def __init__(self, ctx: RunContext, index: int, hosts: list[Host], host_mesh: Any):
        self.ctx = ctx
        self.index = index
        self.hosts = list(hosts)
        self.host_mesh = host_mesh  # one HostMesh over all of `hosts`
        self.spawned = 0  # generations spawned so far (standbys included)
        self.standby: asyncio.Task | None = None  # resolves to a warmed next generation
        self.warming: ReplicaGroup | None = None  # the standby's generation while it warms
        self.orders: dict[Host, asyncio.Future] = {}  # lost host -> the request for its replacement
        self.agent = None  # a HostAgent on each of the group's hosts, once they are up

    def _adopt(self, group: ReplicaGroup) -> None:
        """A spare's warm process set becomes this group's next generation (its standby, in place
        of one on the lost host)."""
        self.abandon_standby()
        group.index, group.generation = self.index, self.spawned
        self.spawned += 1
        self.standby = asyncio.get_running_loop().create_future()
        self.standby.set_result(group)

    async def start_agent(self):
        """A HostAgent on each of the group's hosts (returned); retried, since without one the
        group's exits go unseen and its old ranks cannot be killed."""
        mesh = self.host_mesh
        for attempt in range(1, AGENT_TRIES + 1):
            try:
                agent = await start_host_agent(mesh, f"agent{self.index}x{self.spawned}a{attempt}", self.ctx.cfg.timeouts.spawn_s)
            except Exception as e:
                self.ctx.record.event("host_agent_failed", replica=self.index, attempt=attempt, error=describe_error(e))
                if attempt == AGENT_TRIES or self.host_mesh is not mesh:
                    raise
                await asyncio.sleep(attempt)
                continue
            if self.host_mesh is mesh:  # still this group's hosts
                self.agent = agent
            return agent

    async def release(self) -> None:
        """Tell the live hosts' workers the run is over (bootstrapped nodes then exit)."""
        lost = await self.lost_hosts()
        live = [h for h in self.hosts if h not in lost]
        if not live:
            return
        # A mesh with a dead host would hang: a new one over the live hosts says it instead.
        mesh = await attach_hosts(self.ctx, live) if lost else self.host_mesh
        await asyncio.wait_for(resolved(mesh.shutdown()), self.ctx.cfg.timeouts.stop_s)

    async def spawn(self, standby: bool = False) -> ReplicaGroup:
        """A new generation with processes up and code imported."""
        ctx = self.ctx
        group = ReplicaGroup(self.index, self.spawned, self.hosts, self.host_mesh, ctx.cfg.procs_per_replica)
        self.spawned += 1
        ctx.watch_group(group)
        if standby:
            self.warming = group
        try:
            await group.spawn(ctx.proc_env(self.hosts), ctx.cfg.timeouts.spawn_s)
        except BaseException:
            await self.discard(group)
            raise
        finally:
            if self.warming is group:
                self.warming = None
        return group

    def forget(self, group: ReplicaGroup) -> None:
        """No more failures, shutdown or standby duty for this generation."""
        self.ctx.forget_group(group)

    async def discard(self, group: ReplicaGroup) -> None:
        self.forget(group)
        await group.stop(self.ctx.cfg.timeouts.stop_s)

    def abandon(self, group: ReplicaGroup) -> None:
        """Forget a group with a dead host: stopping a mesh there would hang."""
        self.forget(group)
        group.proc_mesh = None

    def abandon_standby(self) -> ReplicaGroup | None:
        """The standby shared the dead host: drop it without waiting on that host. Returns
        it if it was up (its processes on the hosts still alive are the caller's to end)."""
        task, self.standby = self.standby, None
        if task is None:
            return None
        if task.done() and not task.cancelled() and task.exception() is None:
            self.abandon(task.result())
            return task.result()
        else:
            task.cancel()  # its cleanup waits on the dead host, bounded by timeouts.stop_s
            self.ctx.keep(task)
            return None

    def refill_standby(self) -> None:
        if self.ctx.cfg.ft.standby and not self.ctx.finishing and self.standby is None:
            self.standby = asyncio.ensure_future(self._warm_standby())

    async def _warm_standby(self) -> ReplicaGroup:
        began = time.monotonic()
        group = await self.spawn(standby=True)
        self.ctx.note_standby_ready(self.index, group.generation, time.monotonic() - began)
        return group

    async def build(self, rejoining: bool, data: DataHandover, resume=None,
                    restore_step: int | None = None) -> tuple[ReplicaGroup, bool, dict]:
        """A generation set up to train (from the warm standby if it is alive) and whether it
        was warm, and its setup's answer; raises if it fails, HostError as soon as one of the
        group's hosts dies meanwhile (not after `timeouts.spawn_s`). `resume`: a checkpoint
        (`checkpoints.Found`) it loads at setup; `restore_step`: a step it loads from node memory."""
        build = asyncio.ensure_future(self._build(rejoining, data, resume, restore_step))
        host = await unless_a_host_dies(build, self.ctx.provider, self.hosts, HostWatchdog.of(self.ctx.cfg.hosts), PROBE_EVERY_S)
        if host is None:
            return build.result()
        build.cancel()  # its cleanup (bounded by timeouts.stop_s) goes on without us
        self.ctx.keep(build)
        raise HostError(f"host {host.name} ({host.address}) died while generation {self.spawned - 1} was being built")

    async def _build(self, rejoining: bool, data: DataHandover, resume, restore_step) -> tuple[ReplicaGroup, bool, dict]:
        group = None
        try:
            group, warm = await self.take()
            spec = self.ctx.spec(self.index, resume, restore_step, rejoining)
            return group, warm, await group.setup(spec, rejoining, data, self.ctx.cfg.timeouts.spawn_s)
        except BaseException:
            if group is not None and await self.lost_hosts():
                self.abandon(group)  # stopping it there would hang
            elif group is not None:
                await self.discard(group)
            raise

    async def take(self) -> tuple[ReplicaGroup, bool]:
        """The warm standby if it is alive (one still warming is awaited: it is further along
        than a new spawn), else a freshly spawned generation."""
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
        if task is None:
            return
        warming = self.warming
        if not task.done() and warming is not None and warming.pids and self.agent is not None:
            # It holds nothing yet, and a graceful stop waited seconds on its imports.
            kill_on_hosts(self.agent, warming.pids)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
