"""Where replica groups run: host providers behind one interface.

A host is a machine running a Monarch worker loop (`monarch-sky worker`). The controller
only sees `Host` addresses from a `HostProvider`; it attaches to each host as its own
Monarch HostMesh, so that losing one host never touches the meshes of the others.

Providers:
- `LocalHosts`: this machine; each host is a worker-loop process on loopback, in its own
  process session so it can be killed alone (as a preemption would) and reaped whole.
"""

from __future__ import annotations

import abc
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

RUN_ID_ENV = "MONARCH_SKY_RUN_ID"


@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    port: int

    @property
    def address(self) -> str:
        return f"tcp://{self.ip}:{self.port}"


class HostError(RuntimeError):
    pass


class HostProvider(abc.ABC):
    """Gives the controller hosts; the controller never asks how they were made."""

    @abc.abstractmethod
    def start(self, count: int) -> list[Host]:
        """Hosts for the first `count` replica groups, workers already listening."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every host this provider started. Must not hang."""

    @abc.abstractmethod
    def controller_ip(self) -> str:
        """The address the hosts reach the controller (and the lighthouse) on."""

    def kill(self, host: Host) -> None:
        """Take a host down abruptly (fault injection)."""
        raise HostError(f"{type(self).__name__} cannot kill host {host.name}")


class LocalHosts(HostProvider):
    def __init__(self, run_id: str, env: dict[str, str] | None = None, log_dir: str | None = None):
        self.run_id = run_id
        self.env = env or {}
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, count: int) -> list[Host]:
        hosts = [self._launch(f"local-{i}") for i in range(count)]
        for host in hosts:
            _wait_listening(host, self.procs[host.name], timeout_s=60)
        return hosts

    def _launch(self, name: str) -> Host:
        host = Host(name=name, ip="127.0.0.1", port=free_port())
        env = {**os.environ, **self.env, RUN_ID_ENV: self.run_id}
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab") if self.log_dir else subprocess.DEVNULL
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "monarch_sky", "worker", "--address", host.address],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if log is not subprocess.DEVNULL:
            log.close()
        return host

    def controller_ip(self) -> str:
        return "127.0.0.1"

    def kill(self, host: Host) -> None:
        _kill_session(self.procs[host.name])

    def shutdown(self) -> None:
        for proc in self.procs.values():
            _kill_session(proc)
        self.procs.clear()
        reap_run(self.run_id)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the worker and every process it started (they share its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _wait_listening(host: Host, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HostError(f"worker for host {host.name} exited with code {proc.returncode}")
        try:
            with socket.create_connection((host.ip, host.port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise HostError(f"worker for host {host.name} did not listen on {host.address} within {timeout_s:.0f}s")


def run_processes(run_id: str) -> list:
    """Processes of this machine started for a run (they carry its id in their environment)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(RUN_ID_ENV) == run_id:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def reap_run(run_id: str, timeout_s: float = 10.0) -> int:
    """SIGKILL whatever is left of a run on this machine; returns how many were killed."""
    import psutil

    procs = [p for p in run_processes(run_id) if p.pid != os.getpid()]
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)
    return len(procs)
