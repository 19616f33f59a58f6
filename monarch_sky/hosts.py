"""Where replica groups run: host providers behind one interface.

A host is a machine running a Monarch worker loop (`monarch-sky worker`). The controller
only sees `Host` addresses from a `HostProvider`; it attaches to each replica group's hosts
(`hosts_per_replica` of them) as their own Monarch HostMesh, so that losing one host never
touches the meshes of the other groups.

Providers:
- `LocalHosts`: this machine; each host is a worker-loop process on loopback, in its own
  process group (out of reach of the terminal's Ctrl-C, which the controller handles), so it
  can be killed alone with everything it started, as a preemption would.
  Asked for a replacement, it plays a cloud: a new worker after `provision_delay_s`.
- `AddressListHosts` (`monarch_sky.address_hosts`): a fixed list of `IP:PORT` workers (a
  SkyPilot cluster's nodes, started by `sky/bootstrap.sh`); addresses beyond the first
  `count` are spares for replacements.
- `SkyPilotHosts` (`monarch_sky.sky_hosts`): the same list, and a replacement is a new
  one-node SkyPilot cluster launched from the recipe YAML (worker role only), torn down
  when the run ends.
"""

from __future__ import annotations

import abc
import asyncio
import os
import threading
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

RUN_ID_ENV = "MONARCH_SKY_RUN_ID"  # set on hosts: they and all they start carry it
CONTROLLER_ENV = "MONARCH_SKY_CONTROLLER_RUN"  # set on the controller: its helpers (W&B) carry it
UP, REFUSED, SILENT = "up", "refused", "silent"  # what a probe of a host's worker found (`reach`)


@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    port: int

    @property
    def address(self) -> str:
        from monarch_sky import tls

        return f"{tls.scheme()}://{self.ip}:{self.port}"


class HostError(RuntimeError):
    pass


class HostProvider(abc.ABC):
    """Gives the controller hosts; the controller never asks how they were made.

    Several groups' recoveries call a provider at once, each from its own thread: every
    provider keeps its bookkeeping under `self.lock`.
    """

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


class LocalHosts(HostProvider):
    def __init__(
        self,
        run_id: str,
        log_dir: str | None = None,
        provision_delay_s: float = 3.0,
        max_replacements: int = 3,
    ):
        super().__init__()
        self.run_id = run_id
        self.log_dir = log_dir
        self.provision_delay_s = provision_delay_s
        self.max_replacements = max_replacements
        self.procs: dict[str, subprocess.Popen] = {}
        self._launched = 0
        self._replacements = 0
        self._closed = threading.Event()

    def start(self, count: int) -> list[Host]:
        launched = [self._launch() for _ in range(count)]
        for host, proc in launched:
            _wait_listening(host, proc, timeout_s=60)
        return [host for host, _ in launched]

    def spare_hosts(self, count: int) -> list[Host]:
        """Spares are started with the run, like its first hosts (not replacements)."""
        return self.start(count)

    def provision(self, lost: Host) -> Host:
        with self.lock:
            if self._replacements >= self.max_replacements:
                raise HostError(f"no capacity: all {self.max_replacements} replacement hosts used (hosts.max_replacements)")
            self._replacements += 1
        if self._closed.wait(self.provision_delay_s):  # provisioning, as a cloud would
            raise HostError("the run is shutting down")
        host, proc = self._launch()
        _wait_listening(host, proc, timeout_s=60)
        return host

    def _launch(self) -> tuple[Host, subprocess.Popen]:
        with self.lock:  # never after shutdown has collected the workers to kill
            if self._closed.is_set():
                raise HostError("the run is shutting down")
            name = f"local-{self._launched}"
            self._launched += 1
            host = Host(name=name, ip="127.0.0.1", port=free_port())
            env = {**os.environ, RUN_ID_ENV: self.run_id}
            log = open(os.path.join(self.log_dir, f"{name}.log"), "ab") if self.log_dir else subprocess.DEVNULL
            proc = self.procs[name] = subprocess.Popen(
                self.worker_command(host),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own process group, but the controller's session: separate sessions would
                # put each host in its own scheduler autogroup, and on a shared CPU a recovering
                # host would then get only its 1/N share however idle its priority allows.
                **({"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}),
            )
            if log is not subprocess.DEVNULL:
                log.close()
        return host, proc

    def worker_command(self, host: Host) -> list[str]:
        return [sys.executable, "-m", "monarch_sky", "worker", "--address", host.address]

    def controller_ip(self) -> str:
        return "127.0.0.1"

    def host_pids(self) -> set[int]:
        with self.lock:
            return {proc.pid for proc in self.procs.values()}

    def kill(self, host: Host) -> None:
        with self.lock:
            proc = self.procs.get(host.name)
        if proc is not None:
            _kill_tree(proc)

    def shutdown(self) -> None:
        with self.lock:
            self._closed.set()
            procs, self.procs = list(self.procs.values()), {}
        for proc in procs:
            _kill_tree(proc)
        reap_run(self.run_id)


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


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the worker and every process it started."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        _kill_all([root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _kill_all(procs: list, timeout_s: float = 10.0) -> None:
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _wait_listening(host: Host, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HostError(f"worker for host {host.name} exited with code {proc.returncode}")
        if reachable(host.ip, host.port, timeout_s=1.0):
            return
        time.sleep(0.2)
    raise HostError(f"worker for host {host.name} did not listen on {host.address} within {timeout_s:.0f}s")


def run_processes(run_id: str, keys: tuple[str, ...] = (RUN_ID_ENV,)) -> list:
    """Processes of this machine started for a run (they carry its id in their environment)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if any(env.get(key) == run_id for key in keys):
            found.append(proc)
    return found


def reap_run(run_id: str, keys: tuple[str, ...] = (RUN_ID_ENV,), timeout_s: float = 10.0) -> int:
    """SIGKILL whatever is left of a run on this machine (never this process); returns how many."""
    procs = [p for p in run_processes(run_id, keys) if p.pid != os.getpid()]
    _kill_all(procs, timeout_s)
    return len(procs)


def make_provider(settings, run_id: str, log_dir: str) -> HostProvider:
    """The host provider a job's `hosts.*` settings ask for."""
    if settings.provider == "skypilot":
        from monarch_sky.sky_hosts import SkyPilotHosts

        return SkyPilotHosts(
            list(settings.addresses),
            settings.controller_ip,
            recipe_yaml=settings.recipe_yaml,
            cluster_prefix=settings.cluster_prefix or f"monarch-{run_id}"[:40],
            port=parse_address(settings.addresses[0], name="first").port,
            sky=settings.sky_cli,
            wait_s=settings.provision_timeout_s,
        )
    if settings.provider == "addresses":
        from monarch_sky.address_hosts import AddressListHosts

        return AddressListHosts(
            list(settings.addresses), settings.controller_ip, wait_s=settings.provision_timeout_s
        )
    return LocalHosts(
        run_id,
        log_dir=log_dir,
        provision_delay_s=settings.provision_delay_s,
        max_replacements=settings.max_replacements,
    )
