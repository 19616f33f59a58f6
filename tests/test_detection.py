"""The host watchdog: one failed probe is not a dead host; a failing window is."""

from __future__ import annotations

import socket

from monarch_sky.detection import HostWatchdog
from monarch_sky.hosts import reachable


def test_one_failed_probe_is_not_a_dead_host_but_a_failing_window_is():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    watchdog = HostWatchdog(dead_after_s=2.0)
    assert not watchdog.observe("h", reachable("127.0.0.1", port, 1.0), now=0.0)

    listener.close()  # the worker stops answering
    probe = reachable("127.0.0.1", port, 1.0)
    assert probe is False
    assert not watchdog.observe("h", probe, now=0.5), "one failed probe must not kill a host"

    again = socket.socket()  # it was a blip: the worker answers again
    again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    again.bind(("127.0.0.1", port))
    again.listen()
    assert not watchdog.observe("h", reachable("127.0.0.1", port, 1.0), now=1.0)
    again.close()

    # Now it stays down: dead once the failures span the window, not before.
    times = [1.5, 2.0, 2.5, 3.0, 3.5]
    verdicts = [watchdog.observe("h", reachable("127.0.0.1", port, 1.0), now=t) for t in times]
    assert verdicts == [False, False, False, False, True]


def test_two_quick_failures_inside_the_window_are_not_enough():
    watchdog = HostWatchdog(dead_after_s=2.0)
    assert not watchdog.observe("h", False, now=10.0)
    assert not watchdog.observe("h", False, now=10.1)
    assert watchdog.observe("h", False, now=12.0)


def test_a_host_dying_under_a_build_is_named_by_the_build_watch():
    import asyncio
    import time

    from monarch_sky.detection import first_dead_host
    from monarch_sky.hosts import Host, LocalHosts

    listeners = [socket.socket() for _ in range(2)]
    for s in listeners:
        s.bind(("127.0.0.1", 0))
        s.listen()
    hosts = [Host(f"h{i}", "127.0.0.1", s.getsockname()[1]) for i, s in enumerate(listeners)]
    provider = LocalHosts("unit-watch")

    async def watch():
        asyncio.get_running_loop().call_later(0.5, listeners[1].close)
        return await asyncio.wait_for(first_dead_host(provider, hosts, dead_after_s=1.0, every_s=0.2), 10)

    began = time.monotonic()
    assert asyncio.run(watch()) == hosts[1]
    assert time.monotonic() - began >= 1.5, "declared dead only after failing for dead_after_s"
    listeners[0].close()
