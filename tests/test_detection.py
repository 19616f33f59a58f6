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
