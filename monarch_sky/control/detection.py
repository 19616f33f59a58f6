"""Failure detection beside Monarch supervision: what the hosts themselves see.

Monarch supervision usually reports a dead process within a second, but not always (a
trainer killed mid-step was once reported only 30 s later, by a proc-agent timeout), and it
takes several seconds to give up on a whole host. So the controller also asks, every half
second:
- each host's `HostAgent` (one small process per host of a group, a sibling of the trainers)
  whether any process of the group running there has exited: the host sees a child exit at once;
- the host itself, with a TCP connect to its worker (`HostWatchdog`): a host that does not
  answer is declared dead only after its probes kept failing for `hosts.dead_after_s`, so one
  dropped SYN or a slow name lookup never tears down a healthy group; one that refuses (its
  kernel says nothing listens: the worker is gone) after `hosts.dead_after_refused_s`.
The controller acts on whichever signal comes first (supervision, a failed step call, the
agent, the watchdog).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from monarch.actor import Actor, endpoint

from monarch_sky.common import node_memory
from monarch_sky.common.supervision import resolved
from monarch_sky.hosts.base import REFUSED, UP

PROC_MAIN = "monarch._src.actor.bootstrap_main"  # the module a Monarch proc runs


class HostAgent(Actor):
    """Lives on a host beside its replica groups; reports and ends their processes."""

    @endpoint
    def exited(self, pids: list[int]) -> list[int]:
        """The pids among `pids` that are no longer running (gone, or a zombie)."""
        import psutil

        gone = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    gone.append(pid)
            except psutil.NoSuchProcess:
                gone.append(pid)
        return gone

    @endpoint
    def reap_others(self) -> int:
        """Kill what an earlier controller left on this host: every proc its worker spawned but
        this agent (with their children). Monarch stops such orphans only a minute later, and
        meanwhile they would hold the accelerators a new generation needs. Only Monarch's procs:
        the worker's other children (its log pipe on a node) are the node's."""
        import psutil

        me = psutil.Process()
        worker = me.parent()
        procs = [c for c in (worker.children() if worker else []) if c.pid != me.pid and _is_proc(c)]
        others = [p for child in procs for p in (child, *child.children(recursive=True))]
        for proc in others:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(others, timeout=10)
        return len(others)

    @endpoint
    def memory(self, run_id: str) -> dict:
        """What this host's node memory holds of the run (`node_memory.listing`)."""
        return node_memory.listing(run_id)

    @endpoint
    def note(self, run_id: str, epoch: int, owner: str, step: int | None, note: dict | None) -> tuple[int, str]:
        """Claim this host for controller (`epoch`, `owner`) and keep its note (for a snapshot
        `step`; None: the run's own note; `note` None: the claim alone) unless a controller that
        orders after it claimed the host; returns the claim that holds it."""
        held = node_memory.claim(run_id, epoch, owner)
        if held == (epoch, owner) and note is not None:
            node_memory.write_note(run_id, step, note)
        return held

    @endpoint
    def forget(self, run_id: str) -> int:
        """The run ended: give its node memory back (bytes freed)."""
        return node_memory.drop_run(run_id)

    @endpoint
    def kill(self, pids: list[int]) -> None:
        """SIGKILL a broken group's processes now, so its TorchFT heartbeats stop now."""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _is_proc(process) -> bool:
    """Whether `process` is a Monarch proc (what a worker spawns for a controller's meshes)."""
    try:
        return PROC_MAIN in process.cmdline()
    except Exception:  # noqa: BLE001 - gone meanwhile, or not ours to read
        return False


async def start_host_agent(host_mesh, name: str, timeout_s: float):
    """One process per host of `host_mesh` running a `HostAgent`; returns them (an actor
    mesh over the hosts) once every one answers."""
    procs = host_mesh.spawn_procs(per_host={"gpus": 1}, name=name)
    agent = procs.spawn("host-agent", HostAgent)
    await asyncio.wait_for(resolved(agent.exited.call([])), timeout_s)
    return agent


async def exited_on_hosts(agent, pids_by_host: list[list[int]], timeout_s: float) -> list[int]:
    """Which of a group's pids are gone, each asked of the agent on its own host (a pid
    means nothing on another host)."""
    asks = [resolved(agent.slice(hosts=i).exited.call_one(pids)) for i, pids in enumerate(pids_by_host) if pids]
    return [pid for gone in await asyncio.wait_for(asyncio.gather(*asks), timeout_s) for pid in gone]


def kill_on_hosts(agent, pids_by_host: list[list[int]], skip: tuple[int, ...] = ()) -> None:
    """SIGKILL a group's processes, each by the agent on its own host; `skip`: host indexes
    not to ask (dead ones)."""
    for i, pids in enumerate(pids_by_host):
        if pids and i not in skip:
            agent.slice(hosts=i).kill.broadcast(pids)



class HostWatchdog:
    """Declares a host dead after at least two failed probes spanning `dead_after_s`, or two
    refused in a row spanning `dead_after_refused_s`: a refusal is the host's own answer that
    its worker is gone, where silence may be one lost packet."""

    def __init__(self, dead_after_s: float, dead_after_refused_s: float | None = None):
        self.dead_after_s = dead_after_s
        self.dead_after_refused_s = min(dead_after_refused_s or dead_after_s, dead_after_s)
        self._failing: dict[str, tuple[float, int]] = {}  # host -> (first failure, count)
        self._refused: dict[str, tuple[float, int]] = {}  # host -> (first refusal in a row, count)

    @classmethod
    def of(cls, hosts) -> HostWatchdog:
        """The rule a run's `hosts` settings give."""
        return cls(hosts.dead_after_s, hosts.dead_after_refused_s)

    def observe(self, host: str, state: str, now: float) -> bool:
        """Record one probe of `host` at `now` (`hosts.UP`, `REFUSED` or `SILENT`); True once
        the host counts as dead."""
        if state == UP:
            self.forget(host)
            return False
        self._failing[host] = failing = _counted(self._failing.get(host), now)
        if state == REFUSED:
            self._refused[host] = refused = _counted(self._refused.get(host), now)
            if _spans(refused, now, self.dead_after_refused_s):
                return True
        else:
            self._refused.pop(host, None)
        return _spans(failing, now, self.dead_after_s)

    def forget(self, host: str) -> None:
        self._failing.pop(host, None)
        self._refused.pop(host, None)

    def first_dead(self, hosts: list, probes: list[str], now: float):
        """Record one probe of each of `hosts`; the first that now counts as dead, or None."""
        for host, state in zip(hosts, probes):
            if self.observe(host.address, state, now):
                return host
        return None


def _counted(run: tuple[float, int] | None, now: float) -> tuple[float, int]:
    first, count = run or (now, 0)
    return first, count + 1


def _spans(run: tuple[float, int], now: float, window_s: float) -> bool:
    first, count = run
    return count >= 2 and now - first >= window_s


async def probe_hosts(provider, hosts: list, watchdog: HostWatchdog, timeout_s: float):
    """One round of probes by `watchdog`'s rule: the first host that now counts as dead (or
    None) and what each probe found. A refusal is confirmed at once, `dead_after_refused_s`
    later, instead of at the next round."""
    probes = await asyncio.gather(*(provider.reach(h, timeout_s) for h in hosts))
    dead = watchdog.first_dead(hosts, probes, time.monotonic())
    if dead is None and REFUSED in probes:
        await asyncio.sleep(watchdog.dead_after_refused_s)
        probes = await asyncio.gather(*(provider.reach(h, timeout_s) for h in hosts))
        dead = watchdog.first_dead(hosts, probes, time.monotonic())
    return dead, probes


async def first_dead_host(provider, hosts: list, watchdog: HostWatchdog, every_s: float):
    """Probe `hosts` until one counts as dead by `watchdog`'s rule; returns it. Watches a
    group whose generation is being built, which the controller's watchdog does not."""
    while True:
        dead, _ = await probe_hosts(provider, hosts, watchdog, 2 * every_s)
        if dead is not None:
            return dead
        await asyncio.sleep(every_s)


async def unless_a_host_dies(work: asyncio.Future, provider, hosts: list, watchdog: HostWatchdog, every_s: float):
    """Wait for `work` while watching `hosts`: None once it is done, else the host that died
    first (`work` is then still running: the caller's to cancel)."""
    watch = asyncio.ensure_future(first_dead_host(provider, hosts, watchdog, every_s))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    return None if work.done() else watch.result()
