"""Hot spare hosts (`hosts.spares`): a lost host's group comes back on a host already up.

The pool holds up to `hosts.spares` hosts in no group, each attached (its own HostMesh) and,
where a group is one host, holding a warm process set shaped like a group's generation
(processes up, torch and torchtitan imported, and on GPUs a warm-up step that leaves the
recipe's compiled kernels in the node's cache: `hosts.spare_warm_up`, `warm_up_step`).
A group that loses a host takes a spare at once instead of waiting for the provider
(`Generations.replace_hosts`); its warm process set becomes the group's next generation,
which only builds its trainer and heals from a peer.
The provider then brings a new spare in the background: a new worker (local), the lost
node's worker once it is back (address list), a launched cluster (SkyPilot). A group that
loses a host while no spare is ready claims, in this order, a spare still warming up
(`wait_for_warming`: its rest of a warm-up is never longer than a new host's whole one), then a
refill still on its way from the provider (`claim_refill`), and only then orders its own host.

A spare whose host dies while idle, or whose warm processes fail, is dropped and refilled;
a spare's host is never used by two groups, and every host the pool got is used, kept or
released at the end.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from monarch_sky.common import test_hooks
from monarch_sky.common.supervision import describe_error, resolved
from monarch_sky.control.context import RunContext, off_loop
from monarch_sky.control.detection import HostWatchdog, probe_hosts, unless_a_host_dies
from monarch_sky.control.spare_refills import SpareRefills
from monarch_sky.control.host_replacement import PROBE_EVERY_S, PROBE_TIMEOUT_S, attach_hosts
from monarch_sky.hosts.base import Host
from monarch_sky.recipes import TrainerSpec
from monarch_sky.replica.actor import ReplicaGroup

SPARE_INDEX = -1  # a warm process set in no group yet
WARM_STEPS = 4  # a warm-up's steps (attach, spawn, imports, the warm-up step), each bounded by timeouts.spawn_s


@dataclass
class Spare:
    host: Host
    mesh: Any  # a HostMesh over this one host
    group: ReplicaGroup | None  # its warm process set (groups of one host), else None
    ready_at: float  # monotonic time it was ready
    began: float = 0.0  # monotonic time its attach began

    def age_s(self, now: float) -> float:
        return round(now - self.ready_at, 3)


class SparePool(SpareRefills):
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.size = ctx.cfg.hosts.spares
        self.ready: list[Spare] = []
        self.made = 0  # spares brought up so far (names their process sets)
        self.used = 0
        self.failures = 0  # spares in a row that failed to come up
        self.refills: dict[asyncio.Task, asyncio.Future] = {}  # refill (its _order) -> provider call in flight
        self.warming: list[Host] = []  # hosts being attached and warmed (`_bring`)
        self.claims: dict[Host, asyncio.Future] = {}  # warming host -> the group waiting for it
        self.started = False  # the first spares are up: later ones are refills
        self.watchdog = HostWatchdog.of(ctx.cfg.hosts)

    @property
    def warm(self) -> bool:
        """A spare can hold a whole generation only where a group is one host."""
        return self.ctx.cfg.hosts_per_replica == 1

    async def start(self) -> None:
        """The first spares: hosts the provider has up beyond the groups' (extra addresses, or
        local workers started now). Fewer than `hosts.spares` is said, not fatal."""
        if self.size == 0:
            return
        hosts = await asyncio.wait_for(off_loop(self.ctx.provider.spare_hosts, self.size),
                                       self.ctx.cfg.hosts.provision_timeout_s)
        if len(hosts) < self.size:
            self.ctx.record.event("spares_short", wanted=self.size, got=len(hosts))
            self.ctx.display.line(f"monarch-sky: hosts.spares={self.size} but only {len(hosts)} spare host(s) are up; "
                                  "a lost host beyond those waits for a replacement")
        await asyncio.gather(*(self._bring(host) for host in hosts))
        self.started = True

    async def _bring(self, host: Host) -> None:
        """Attach `host` and warm a process set on it: the pool's spare, or the group's that
        claimed it while it warmed."""
        self.warming.append(host)
        spare = None
        try:
            spare = await self._warm_watched(host)
        finally:
            self.warming.remove(host)
            claim = self.claims.pop(host, None)
            claimed = claim is not None and not claim.done()  # the claimant may have stopped waiting
            if claimed:
                claim.set_result(spare)  # None: it orders a host of its own
        if spare is None or claimed:
            return
        self.ready.append(spare)
        self._say_ready(spare)

    def _say_ready(self, spare: Spare, claimed_by: int | None = None) -> None:
        seconds = round(spare.ready_at - spare.began, 3)
        step_s = spare.group.timings.get("warm_up_step_s") if spare.group is not None else None
        self.ctx.record.event("spare_ready", host=spare.host.address, warm=spare.group is not None, seconds=seconds,
                              warm_up_step_s=step_s, pool=len(self.ready),
                              **({} if claimed_by is None else {"claimed_by": claimed_by}))
        to = "" if claimed_by is None else f" for replica {claimed_by}, which claimed it while it warmed"
        self.ctx.display.line(f"monarch-sky: spare host {spare.host.name} ready ({'warm' if spare.group else 'attached'}, "
                              f"{seconds:.1f}s){to}; pool {len(self.ready)}/{self.size}")

    async def _warm_watched(self, host: Host) -> Spare | None:
        """The spare on `host`, watching the host meanwhile; None (said and handled) if it failed."""
        ctx = self.ctx
        work = asyncio.ensure_future(self._attach_and_warm(host))
        try:
            dead = await unless_a_host_dies(work, ctx.provider, [host], HostWatchdog.of(ctx.cfg.hosts), PROBE_EVERY_S)
            spare = work.result() if dead is None else None
        except Exception as e:
            await self._failed(host, describe_error(e), alive=await ctx.provider.probe(host, PROBE_TIMEOUT_S))
            return None
        if spare is None:
            work.cancel()
            ctx.keep(work)
            await self._failed(host, "its host died while it was being warmed", alive=False)
            return None
        self.failures = 0
        return spare

    async def wait_for_warming(self, lost: Host, replica: int) -> Spare | None:
        """For a group that lost `lost` while no spare is ready: a spare still warming up,
        waited for, or None if none is warming or it failed. The wait is bounded by what
        bounds a warm-up (an attach and a spawn, each `timeouts.spawn_s`)."""
        host = next((h for h in self.warming if h not in self.claims), None)
        if host is None:
            return None
        claim = self.claims[host] = asyncio.get_running_loop().create_future()
        self.ctx.record.event("spare_warming_claimed", replica=replica, host=host.address, instead_of=lost.address)
        timeout_s = WARM_STEPS * self.ctx.cfg.timeouts.spawn_s + test_hooks.refill_warm_delay_s()
        try:
            spare = await asyncio.wait_for(claim, timeout_s)  # cancels the claim on timeout: the pool keeps it
        except asyncio.TimeoutError:
            return None
        if spare is not None:
            self.used += 1
            self._say_ready(spare, claimed_by=replica)
            self.refill(lost)
        return spare

    async def _attach_and_warm(self, host: Host) -> Spare:
        ctx, began = self.ctx, time.monotonic()
        mesh = await attach_hosts(ctx, [host])
        group = None
        if self.warm:
            group = ReplicaGroup(SPARE_INDEX, 0, [host], mesh, ctx.cfg.procs_per_replica, owner=f"s{self.made}")
            self.made += 1
            ctx.watch_group(group)
            try:
                await group.spawn(ctx.proc_env([host]), ctx.cfg.timeouts.spawn_s)
                spec = TrainerSpec.from_job(ctx.cfg, 0, ctx.dump_folder(0))  # the recipe's shapes: any group's
                await group.warm_up_step(spec, ctx.cfg.hosts.spare_warm_up, ctx.cfg.timeouts.spawn_s)
            except BaseException:
                ctx.forget_group(group)
                await self._stop_or_abandon(group)
                raise
        if self.started and test_hooks.refill_warm_delay_s():
            await asyncio.sleep(test_hooks.refill_warm_delay_s())
        return Spare(host, mesh, group, time.monotonic(), began)

    async def _stop_or_abandon(self, group: ReplicaGroup) -> None:
        """A warm process set that failed: stopped where its host answers (the next set on that
        host would share its accelerators), left to its worker's end where the host is dead
        (stopping it there could hang)."""
        if await self.ctx.provider.probe(group.hosts[0], PROBE_TIMEOUT_S):
            try:
                await group.stop(self.ctx.cfg.timeouts.stop_s)
                return
            except Exception as e:
                self.ctx.record.event("spare_stop_failed", host=group.hosts[0].address, error=describe_error(e))
        group.proc_mesh = None

    async def _fence(self, host: Host) -> None:
        """A spare host declared dead: stopped where the provider can stop hosts, else retired
        (a launched cluster goes down; a node of the cluster is left to come back)."""
        provider = self.ctx.provider
        if provider.can_stop_hosts:
            await self.ctx.provider_call(provider.kill, host, what=f"fencing spare host {host.name}")
        else:
            provider.retire(host)

    async def _failed(self, host: Host, reason: str, alive: bool) -> None:
        """A spare that could not be brought up: a dead host is fenced and replaced; a live
        one is given back to the provider, and the pool tries again (a few times in a row)."""
        self.ctx.display.line(f"monarch-sky: spare host {host.name} could not be warmed: {reason}")
        if not self.ctx.finishing:
            if alive:
                self.ctx.provider.give_back(host)
            else:
                await self._fence(host)
        self._count_failure(host, "spare_failed", host=host.address, reason=reason, host_alive=alive)

    async def take(self, lost: Host) -> Spare | None:
        """A live spare for a group that lost `lost` (the pool refills in its place), or None."""
        while self.ready:
            spare = self.ready.pop(0)
            alive = await self.ctx.provider.probe(spare.host, PROBE_TIMEOUT_S)
            if alive and not self._broken(spare):
                self.used += 1
                self.refill(lost)
                return spare
            await self._drop(spare, "its host did not answer when it was needed" if not alive else spare.group.failure, alive)
        return None

    async def check(self) -> None:
        """Probe the idle spares (with the watchdog's rule); drop a dead or broken one."""
        spares = list(self.ready)
        dead, _ = await probe_hosts(self.ctx.provider, [s.host for s in spares], self.watchdog, PROBE_TIMEOUT_S)
        for spare in spares:
            if spare in self.ready and (spare.host == dead or self._broken(spare)):
                self.ready.remove(spare)
                alive = spare.host != dead
                await self._drop(spare, spare.group.failure if alive else "its host died while idle", alive)

    def _broken(self, spare: Spare) -> bool:
        return spare.group is not None and spare.group.failure is not None

    async def _drop(self, spare: Spare, reason: str, alive: bool) -> None:
        """A dead spare host is fenced and replaced; a live one whose warm processes failed
        gets a new process set."""
        self.watchdog.forget(spare.host.address)
        self.ctx.record.event("spare_lost", host=spare.host.address, reason=reason, host_alive=alive)
        self.ctx.display.line(f"monarch-sky: spare host {spare.host.name} dropped: {reason}")
        if spare.group is not None:
            self.ctx.forget_group(spare.group)
        if alive:
            if spare.group is not None:
                await spare.group.stop(self.ctx.cfg.timeouts.stop_s)
            self.ctx.in_background(self._bring(spare.host))
            return
        if spare.group is not None:
            spare.group.proc_mesh = None  # stopping it on a dead host could hang
        await self._fence(spare.host)
        self.refill(spare.host)

    async def release(self) -> None:
        """The run is over: tell the idle spares' workers (bootstrapped nodes then exit)."""
        spares, self.ready = self.ready, []
        await asyncio.gather(*(asyncio.wait_for(resolved(s.mesh.shutdown()), self.ctx.cfg.timeouts.stop_s)
                               for s in spares), return_exceptions=True)

    def summary(self) -> dict[str, Any]:
        return {"size": self.size, "used": self.used, "ready": len(self.ready), "warm": self.warm}
