"""Workers at fixed addresses: the nodes of a SkyPilot cluster, started by `sky/bootstrap.sh`."""

from __future__ import annotations

import os
import threading
import time

from monarch_sky.hosts.base import LOST_IPS_ENV, Host, HostError, HostProvider, parse_address

COMEBACK_PORT_STEP = 100  # a node's restarted worker listens this much above the last one
COMEBACK_PORTS = 5  # how many such moves the controller looks for
PASS_OVER_S = 10.0  # at start, a host still silent this long is passed over when enough others listen


class AddressListHosts(HostProvider):
    """Workers at fixed addresses, already running (started by the node bootstrap)."""

    def __init__(self, addresses: list[str], controller_ip: str, wait_s: float = 300.0):
        super().__init__()
        self.hosts = [parse_address(a, name=f"node-{i}") for i, a in enumerate(addresses)]
        self._controller_ip = controller_ip
        self.wait_s = wait_s
        self._closed = threading.Event()

    def start(self, count: int) -> list[Host]:
        """The first `count` hosts whose workers listen, in address order; the rest are
        spares. All are waited for a while, but a node lost for good (the one whose controller
        this run goes on from, say) is passed over once enough others listen: it stays a spare,
        handed out only if it comes back. Nodes a standby found silent (`LOST_IPS_ENV`) are
        passed over at once."""
        if count > len(self.hosts):
            raise HostError(f"{count} replica groups need {count} hosts, but only {len(self.hosts)} addresses were given")
        began = time.monotonic()
        lost = {ip for ip in os.environ.get(LOST_IPS_ENV, "").split(",") if ip}  # a standby's word
        awaited = [h for h in self.hosts if h.ip not in lost]
        while True:
            up = [h for h in awaited if self.alive(h)]
            waited = time.monotonic() - began
            if len(up) >= count and (len(up) == len(awaited) or waited > PASS_OVER_S):
                break
            if waited > self.wait_s:
                down = " ".join(h.address for h in self.hosts if h not in up)
                raise HostError(f"{count} replica groups need {count} hosts, but only {len(up)} workers listen "
                                f"within {self.wait_s:.0f}s (none at {down})")
            if self._closed.wait(1.0):
                raise HostError("the run is shutting down")
        order = up + [h for h in self.hosts if h not in up]
        with self.lock:
            self.spares = order[count:]
        return order[:count]

    def provision(self, lost: Host) -> Host:
        """No spare is left: the lost node's worker once it is back, on a port
        COMEBACK_PORT_STEP above the lost one (sky/bootstrap.sh moves a restarted worker
        there), since Monarch 0.7.0 never attaches a controller to a new worker at the
        address of one that died under it. The lost address itself comes last: a job group's
        relaunched task keeps its name and port on a new pod (its attach is untested)."""
        comebacks = [
            Host(name=f"{lost.name}-p{port}", ip=lost.ip, port=port)
            for port in range(lost.port + COMEBACK_PORT_STEP, 65536, COMEBACK_PORT_STEP)[:COMEBACK_PORTS]
        ]
        return self._wait_up(*comebacks, lost)

    def _wait_up(self, *hosts: Host) -> Host:
        """The first of `hosts` whose worker listens (within wait_s)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            for host in hosts:
                if self.alive(host):
                    return host
            if time.monotonic() > deadline:
                where = " or ".join(h.address for h in hosts)
                raise HostError(f"no worker listening at {where} within {self.wait_s:.0f}s")
            if self._closed.wait(1.0):
                raise HostError("the run is shutting down")

    def controller_ip(self) -> str:
        return self._controller_ip

    def shutdown(self) -> None:
        self._closed.set()  # the workers belong to the nodes; Monarch stops our processes
