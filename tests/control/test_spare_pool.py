"""The spare pool's bookkeeping, path by path: claim, refill, a claim on a spare still warming,
a failed warm-up, a dead spare, a refill that comes late, failures in a row.

The provider counts what the pool asks of it; Monarch's side (attaching a host, spawning and
warming its process set) is a stand-in that records which process sets are alive on which host.
The e2e spare tests (`make e2e`, `make chaos`) run the same paths on real hosts.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from monarch_sky.common import platform as platform_mod
from monarch_sky.config import load_job
from monarch_sky.control import spare_refills, spares
from monarch_sky.control.context import RunContext
from monarch_sky.hosts.base import REFUSED, UP, Host, HostProvider
from monarch_sky.record.progress import Display
from monarch_sky.record.tracking import RunRecord

LOST = Host("lost", "10.0.0.9", 1)


class CountingHosts(HostProvider):
    """Hosts made on request (after `delay_s`; `fail` more requests raise), none of them
    stoppable, as with fixed addresses or SkyPilot."""

    def __init__(self, delay_s: float = 0.0, fail: int = 0):
        super().__init__()
        self.delay_s, self.fail = delay_s, fail
        self.made, self.dead, self.retired, self.given_back = 0, set(), [], []

    def start(self, count: int) -> list[Host]:
        return []

    def spare_hosts(self, count: int) -> list[Host]:
        return [self._new() for _ in range(count)]

    def provision(self, lost: Host) -> Host:
        time.sleep(self.delay_s)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("no capacity")
        return self._new()

    def _new(self) -> Host:
        self.made += 1
        return Host(f"h{self.made}", "127.0.0.1", 1000 + self.made)

    def give_back(self, host: Host) -> None:
        self.given_back.append(host.name)
        super().give_back(host)

    def retire(self, host: Host) -> None:
        self.retired.append(host.name)

    def alive(self, host: Host, timeout_s: float = 2.0) -> bool:
        return host.name not in self.dead

    async def reach(self, host: Host, timeout_s: float) -> str:
        return REFUSED if host.name in self.dead else UP

    def shutdown(self) -> None:
        pass

    def controller_ip(self) -> str:
        return "127.0.0.1"


class WarmSets:
    """Stands in for Monarch: the process sets alive on each host; `failing` warm-ups fail."""

    def __init__(self, failing: int = 0, warm_s: float = 0.0):
        self.alive: dict[str, int] = {}
        self.failing, self.warm_s = failing, warm_s
        sets = self

        class Group:
            def __init__(self, index, generation, hosts, mesh, procs, owner):
                self.hosts, self.owner, self.failure, self.timings, self.proc_mesh = hosts, owner, None, {}, object()

            async def spawn(self, env, timeout_s):
                sets.alive[self.hosts[0].name] = sets.alive.get(self.hosts[0].name, 0) + 1

            async def warm_up_step(self, spec, warm, timeout_s):
                await asyncio.sleep(sets.warm_s)
                if sets.failing:
                    sets.failing -= 1
                    raise RuntimeError("warm-up failed")

            async def stop(self, timeout_s):
                sets.alive[self.hosts[0].name] -= 1

        self.Group = Group


def pool(tmp_path, monkeypatch, provider: CountingHosts, sets: WarmSets, *overrides: str) -> spares.SparePool:
    job = load_job(["recipe=llama3_debug", "hosts.spares=1", *overrides])
    cpu = platform_mod.Platform("cpu", "gloo", 0, (), "")
    ctx = RunContext(job.config, provider=provider, record=RunRecord(str(tmp_path), "run"), tracker=None,
                     display=Display(10), platform=cpu)
    ctx.router = SimpleNamespace(watch=lambda owner: None, unwatch=lambda owner: None)

    async def attach(ctx, hosts):
        return SimpleNamespace(shutdown=lambda: None)

    monkeypatch.setattr(spares, "attach_hosts", attach)
    monkeypatch.setattr(spares, "ReplicaGroup", sets.Group)
    return spares.SparePool(ctx)


def events(p: spares.SparePool, name: str) -> list[dict]:
    import json

    lines = p.ctx.record.events_path.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


async def until(what, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_spare_taken_is_refilled(tmp_path, monkeypatch):
    provider = CountingHosts()
    p = pool(tmp_path, monkeypatch, provider, WarmSets())

    async def go():
        await p.start()
        spare = await p.take(LOST)
        assert spare is not None and spare.host.name == "h1"
        await until(lambda: [s.host.name for s in p.ready] == ["h2"])

    asyncio.run(go())
    assert p.used == 1 and provider.made == 2


def test_a_group_claims_a_refill_on_its_way_and_the_pool_orders_another(tmp_path, monkeypatch):
    provider = CountingHosts(delay_s=0.5)
    p = pool(tmp_path, monkeypatch, provider, WarmSets())

    async def go():
        await p.start()
        await p.take(LOST)
        await until(lambda: p.refills)  # the refill is on its way now
        call = p.claim_refill(LOST)
        assert call is not None
        host = await call
        assert host.name == "h2", "the group gets the refill the pool had ordered"
        await until(lambda: [s.host.name for s in p.ready] == ["h3"])

    asyncio.run(go())


def test_a_group_claims_a_spare_still_warming(tmp_path, monkeypatch):
    p = pool(tmp_path, monkeypatch, CountingHosts(), WarmSets(warm_s=0.5))

    async def go():
        start = asyncio.ensure_future(p.start())
        await until(lambda: p.warming)
        spare = await p.wait_for_warming(LOST, replica=1)
        await start
        assert spare is not None and spare.host.name == "h1"
        assert p.ready == [] or p.ready[0].host.name != "h1", "a claimed spare is never also the pool's"

    asyncio.run(go())
    assert events(p, "spare_warming_claimed")[0]["replica"] == 1


def test_a_failed_warm_up_on_a_live_host_stops_its_processes_before_the_next(tmp_path, monkeypatch):
    provider = CountingHosts()
    sets = WarmSets(failing=1)
    p = pool(tmp_path, monkeypatch, provider, sets)

    async def go():
        await p.start()
        await until(lambda: [s.host.name for s in p.ready] == ["h1"])

    asyncio.run(go())
    assert sets.alive == {"h1": 1}, "one process set on the host: the failed one was stopped"
    assert provider.given_back == ["h1"] and events(p, "spare_failed")[0]["host_alive"] is True


def test_a_dead_spare_is_retired_not_killed(tmp_path, monkeypatch):
    provider = CountingHosts()
    p = pool(tmp_path, monkeypatch, provider, WarmSets(), "hosts.dead_after_refused_s=0.01")

    async def go():
        await p.start()
        provider.dead.add("h1")
        for _ in range(3):
            await p.check()
        await until(lambda: [s.host.name for s in p.ready] == ["h2"])

    asyncio.run(go())
    assert provider.retired == ["h1"]
    assert events(p, "provider_error") == [], "a provider that cannot stop hosts is not asked to"


def test_a_refill_that_comes_late_joins_the_pool(tmp_path, monkeypatch):
    provider = CountingHosts()
    p = pool(tmp_path, monkeypatch, provider, WarmSets(), "hosts.provision_timeout_s=0.3")

    async def go():
        await p.start()
        provider.delay_s = 1.0
        await p.take(LOST)
        await until(lambda: events(p, "spare_refill_late"))
        assert p.ready == []
        await until(lambda: [s.host.name for s in p.ready] == ["h2"])

    asyncio.run(go())
    assert provider.given_back == [], "the pool took it: not left idle with the provider"


def test_refills_pause_after_failures_in_a_row_then_go_on(tmp_path, monkeypatch):
    monkeypatch.setattr(spare_refills, "REFILL_PAUSE_S", 0.5)
    provider = CountingHosts()
    p = pool(tmp_path, monkeypatch, provider, WarmSets())

    async def go():
        await p.start()
        provider.fail = spare_refills.MAX_FAILURES_IN_A_ROW
        await p.take(LOST)
        await until(lambda: events(p, "spares_paused"))
        assert len(events(p, "spare_refill_failed")) == spare_refills.MAX_FAILURES_IN_A_ROW
        await until(lambda: [s.host.name for s in p.ready] == ["h2"])

    asyncio.run(go())
    assert p.failures == 0


@pytest.fixture(autouse=True)
def _no_display_noise(monkeypatch):
    monkeypatch.setattr(Display, "line", lambda self, text: None)
