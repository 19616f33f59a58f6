"""The host watchdog: one failed probe is not a dead host; a failing window is (a short one
where the host refuses: its worker is gone)."""

from __future__ import annotations

import socket

import asyncio

from monarch_sky.control.detection import HostWatchdog
from monarch_sky.hosts.base import REFUSED, SILENT, UP, Host
from monarch_sky.hosts.local import LocalHosts


def _reach(port: int, timeout_s: float = 0.5) -> str:
    return asyncio.run(LocalHosts("unit-reach").reach(Host("h", "127.0.0.1", port), timeout_s))


def _silent_listener() -> tuple[socket.socket, socket.socket]:
    """A worker whose host drops new connections unanswered (a full accept queue), as a
    lost packet or a powered-off host would."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    queued = socket.create_connection(listener.getsockname(), 1.0)  # fills the queue
    return listener, queued


def test_a_probe_tells_a_worker_that_answers_from_one_refused_and_from_silence():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert _reach(port) == UP
    listener.close()
    assert _reach(port) == REFUSED
    silent, queued = _silent_listener()
    assert _reach(silent.getsockname()[1]) == SILENT
    queued.close()
    silent.close()


def test_one_failed_probe_is_not_a_dead_host_but_a_failing_window_is():
    listener, queued = _silent_listener()
    port = listener.getsockname()[1]
    watchdog = HostWatchdog(dead_after_s=2.0, dead_after_refused_s=0.5)
    assert not watchdog.observe("h", UP, now=0.0)

    probe = _reach(port)  # the worker stops answering
    assert probe == SILENT
    assert not watchdog.observe("h", probe, now=0.5), "one failed probe must not kill a host"
    assert not watchdog.observe("h", UP, now=1.0), "it was a blip: the worker answers again"

    # Now it stays silent: dead once the failures span the window, not before.
    times = [1.5, 2.0, 2.5, 3.0, 3.5]
    verdicts = [watchdog.observe("h", _reach(port, 0.1), now=t) for t in times]
    assert verdicts == [False, False, False, False, True]
    queued.close()
    listener.close()


def test_a_worker_that_refuses_is_dead_after_the_shorter_window():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # the host answers: nothing listens on the worker's port
    watchdog = HostWatchdog(dead_after_s=2.0, dead_after_refused_s=0.5)
    assert not watchdog.observe("h", _reach(port), now=0.0), "one refusal is not yet a dead host"
    assert watchdog.observe("h", _reach(port), now=0.5)
    # A silent probe breaks the run of refusals: the long window applies again.
    assert not watchdog.observe("g", REFUSED, now=0.0)
    assert not watchdog.observe("g", SILENT, now=0.5)
    assert not watchdog.observe("g", REFUSED, now=1.0)
    assert watchdog.observe("g", REFUSED, now=1.5), "two refusals in a row, 0.5 s apart"
    # The refused window is never longer than the silent one.
    assert HostWatchdog(dead_after_s=0.3, dead_after_refused_s=0.5).dead_after_refused_s == 0.3


def test_two_quick_failures_inside_the_window_are_not_enough():
    watchdog = HostWatchdog(dead_after_s=2.0, dead_after_refused_s=0.5)
    assert not watchdog.observe("h", SILENT, now=10.0)
    assert not watchdog.observe("h", SILENT, now=10.1)
    assert watchdog.observe("h", SILENT, now=12.0)
    assert not watchdog.observe("r", REFUSED, now=10.0)
    assert not watchdog.observe("r", REFUSED, now=10.1)
    assert watchdog.observe("r", REFUSED, now=10.5)


def test_a_host_dying_under_a_build_is_named_by_the_build_watch():
    import time

    from monarch_sky.control.detection import first_dead_host

    listeners = [socket.socket() for _ in range(2)]
    for s in listeners:
        s.bind(("127.0.0.1", 0))
        s.listen()
    hosts = [Host(f"h{i}", "127.0.0.1", s.getsockname()[1]) for i, s in enumerate(listeners)]
    provider = LocalHosts("unit-watch")

    async def watch():
        asyncio.get_running_loop().call_later(0.5, listeners[1].close)
        return await asyncio.wait_for(first_dead_host(provider, hosts, HostWatchdog(dead_after_s=1.0), every_s=0.2), 10)

    began = time.monotonic()
    assert asyncio.run(watch()) == hosts[1]
    assert time.monotonic() - began >= 1.5, "declared dead only after failing for dead_after_s"
    listeners[0].close()


def test_one_round_of_probes_confirms_a_refusal_at_once_but_not_silence():
    from monarch_sky.control.detection import probe_hosts

    up = socket.socket()
    up.bind(("127.0.0.1", 0))
    up.listen()
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    gone_port = gone.getsockname()[1]
    gone.close()
    silent, queued = _silent_listener()
    hosts = [Host("up", "127.0.0.1", up.getsockname()[1]), Host("gone", "127.0.0.1", gone_port),
             Host("silent", "127.0.0.1", silent.getsockname()[1])]
    watchdog = HostWatchdog(dead_after_s=5.0, dead_after_refused_s=0.2)
    dead, probes = asyncio.run(probe_hosts(LocalHosts("unit-round"), hosts, watchdog, 0.3))
    assert dead == hosts[1], "the refusing host is confirmed within the same round"
    assert probes == [UP, REFUSED, SILENT]
    dead, _ = asyncio.run(probe_hosts(LocalHosts("unit-round"), [hosts[0], hosts[2]], watchdog, 0.3))
    assert dead is None, "a silent host waits out dead_after_s"
    for s in (up, silent, queued):
        s.close()
