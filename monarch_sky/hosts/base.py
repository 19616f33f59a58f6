"""Where replica groups run: host providers behind one interface.

A host is a machine running a Monarch worker loop (`monarch-sky worker`). The controller
only sees `Host` addresses from a `HostProvider`; it attaches to each replica group's hosts
(`hosts_per_replica` of them) as their own Monarch HostMesh, so that losing one host never
touches the meshes of the other groups.

This module holds what every provider shares (`Host`, `HostProvider`, the probe). Providers:
- `LocalHosts` (`monarch_sky.hosts.local`): this machine; each host is a worker-loop process on
  loopback, in its own process group (out of reach of the terminal's Ctrl-C, which the
  controller handles), so it can be killed alone with everything it started, as a preemption
  would. Asked for a replacement, it plays a cloud: a new worker after `provision_delay_s`.
- `AddressListHosts` (`monarch_sky.hosts.addresses`): a fixed list of `IP:PORT` workers (a
  SkyPilot cluster's nodes, started by `sky/bootstrap.sh`); addresses beyond the first
  `count` are spares for replacements.
- `SkyPilotHosts` (`monarch_sky.hosts.sky`): the same list, and a replacement is a new
  one-node SkyPilot cluster launched from the recipe YAML (worker role only), torn down
  when the run ends.
`monarch_sky.hosts.choice.make_provider` picks one from the job's `hosts.*` settings.
"""

from __future__ import annotations

import abc
import asyncio
import socket
import threading
from dataclasses import dataclass

RUN_ID_ENV = "MONARCH_SKY_RUN_ID"  # set on hosts: they and all they start carry it
CONTROLLER_ENV = "MONARCH_SKY_CONTROLLER_RUN"  # set on the controller: its helpers (W&B) carry it
LOST_AT_ENV = "MONARCH_SKY_CONTROLLER_LOST_AT"  # when a standby saw the run's previous controller lost (epoch s)
LOST_IPS_ENV = "MONARCH_SKY_LOST_IPS"  # the nodes a standby found silent, comma-separated: not waited for at start
UP, REFUSED, SILENT = "up", "refused", "silent"  # what a probe of a host's worker found (`reach`)


@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    port: int

    @property
    def address(self) -> str:
        from monarch_sky.hosts import tls

        return f"{tls.scheme()}://{self.ip}:{self.port}"


class HostError(RuntimeError):
    pass


class HostProvider(abc.ABC):
    """Gives the controller hosts; the controller never asks how they were made.

    Several groups' recoveries call a provider at once, each from its own thread: every
    provider keeps its bookkeeping under `self.lock`.
    """

    can_stop_hosts = False  # whether `kill` can take a host down (local ones: yes; bare addresses: no)
    release_s = 5.0  # how long the run's end waits for `shutdown` (SkyPilot's cluster downs take minutes)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spares: list[Host] = []  # hosts up and in no group, handed out before new ones

    @abc.abstractmethod
    def start(self, count: int) -> list[Host]:
        """Hosts for the first `count` replica groups, workers already listening."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every host this provider started. Must not hang."""

    @abc.abstractmethod
    def controller_ip(self) -> str:
        """The address the hosts reach the controller (and the lighthouse) on."""

    def host_pids(self) -> set[int]:
        """The host workers this provider runs on this machine (none but the local ones)."""
        return set()

    def replace(self, lost: Host) -> Host:
        """A host, worker listening, for the group that ran on `lost`: a live spare if there
        is one, else a new one (`provision`). Blocks while capacity is provisioned; raises
        HostError when there is none. The controller bounds the wait with
        `hosts.provision_timeout_s`."""
        while (spare := self._take_spare()) is not None:
            if self.alive(spare):
                return spare
        return self.provision(lost)

    def spare_hosts(self, count: int) -> list[Host]:
        """Up to `count` hosts up and in no group, for the spare pool (`hosts.spares`): the
        ones beyond the groups' (extra addresses). Those it takes are no longer `spares`."""
        taken = []
        while len(taken) < count and (host := self._take_spare()) is not None:
            if self.alive(host):
                taken.append(host)
        return taken

    def give_back(self, host: Host) -> None:
        """A host obtained from `replace` that no group took (its group was given up, or
        the run stopped waiting for it): the next `replace` hands it out."""
        with self.lock:
            self.spares.append(host)

    def _take_spare(self) -> Host | None:
        with self.lock:
            return self.spares.pop(0) if self.spares else None

    @abc.abstractmethod
    def provision(self, lost: Host) -> Host:
        """A new host for the group that ran on `lost` (no spare was left)."""

    def retire(self, host: Host) -> None:
        """`host` was lost and no group will use it again: stop paying for it if this provider
        launched it (a replacement cluster). Must not block."""

    def left_up(self) -> list[str]:
        """What this provider launched and could not take down (after `shutdown`): the run's
        summary names it, with the command that does."""
        return []

    def kill(self, host: Host) -> None:
        """Take a host down abruptly (fault injection)."""
        raise HostError(f"{type(self).__name__} cannot kill host {host.name}")

    def alive(self, host: Host, timeout_s: float = 2.0) -> bool:
        """Whether the host's worker still accepts connections."""
        return reachable(host.ip, host.port, timeout_s)

    async def probe(self, host: Host, timeout_s: float) -> bool:
        """`alive` on the event loop, no thread."""
        return await self.reach(host, timeout_s) == UP

    async def reach(self, host: Host, timeout_s: float) -> str:
        """How the host's worker answers a TCP connect (the watchdog asks every host twice a
        second): UP; REFUSED, the host itself answered that nothing listens there (its worker
        is gone); or SILENT, no answer in `timeout_s` (the host is down, or a packet was lost)."""
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.ip, host.port), timeout_s)
        except ConnectionRefusedError:
            return REFUSED
        except (OSError, asyncio.TimeoutError):
            return SILENT
        writer.close()
        return UP


def parse_address(address: str, name: str) -> Host:
    """`IP:PORT`, `tcp://IP:PORT` or `tls://IP:PORT` -> Host."""
    text = address.strip().removeprefix("tcp://").removeprefix("tls://")
    ip, sep, port = text.rpartition(":")
    if not sep or not ip or not port.isdigit():
        raise HostError(f"'{address}' is not IP:PORT")
    return Host(name=name, ip=ip, port=int(port))


def reachable(ip: str, port: int, timeout_s: float = 2.0) -> bool:
    """A TCP connect: the kernel of a live host accepts it however busy the listener is."""
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]
