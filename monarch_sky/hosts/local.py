"""`LocalHosts`: replica groups' hosts as worker-loop processes on this machine (loopback).

Each worker runs in its own process group (out of reach of the terminal's Ctrl-C, which the
controller handles), so it can be killed alone with everything it started, as a preemption
would. Asked for a replacement, it plays a cloud: a new worker after `provision_delay_s`.
Also: finding and reaping every process of a run on this machine (`run_processes`, `reap_run`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from monarch_sky.common import node_memory
from monarch_sky.hosts.base import RUN_ID_ENV, Host, HostError, HostProvider, free_port, reachable


class LocalHosts(HostProvider):
    can_stop_hosts = True

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
        """`count` hosts; under a run id whose earlier controller was lost, first the simulated
        machines that still hold the run's node memory, as a cluster's machines outlive its
        controller (`kept_machines`)."""
        kept = self._kept_machines()[:count] if not self.procs else []
        launched = [self._launch(name) for name in kept] + [self._launch() for _ in range(count - len(kept))]
        for host, proc in launched:
            _wait_listening(host, proc, timeout_s=60)
        return [host for host, _ in launched]

    def spare_hosts(self, count: int) -> list[Host]:
        """Spares are started with the run, like its first hosts (not replacements)."""
        return self.start(count)

    def _kept_machines(self) -> list[str]:
        """The local hosts whose memory holds this run's snapshots, in the order their groups
        held them (group, then rank: a group spanning hosts gets its own back in order), the
        newest first where two held the same rank. No new host takes the name of one that holds
        any of the run's memory."""
        held = []
        for folder in (node_memory.root() / "local-hosts").glob("local-*"):
            index = folder.name.removeprefix("local-")
            if index.isdigit() and (folder / self.run_id).exists():
                self._launched = max(self._launched, int(index) + 1)
            snapshots = node_memory.snapshots(folder / self.run_id)
            if snapshots:
                group, rank, step = max(snapshots, key=lambda s: s[2])
                held.append(((group, rank, -step), folder.name))
        return [name for _, name in sorted(held)]

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

    def _launch(self, name: str | None = None) -> tuple[Host, subprocess.Popen]:
        with self.lock:  # never after shutdown has collected the workers to kill
            if self._closed.is_set():
                raise HostError("the run is shutting down")
            if name is None:
                name = f"local-{self._launched}"
                self._launched += 1
            host = Host(name=name, ip="127.0.0.1", port=free_port())
            env = {**os.environ, RUN_ID_ENV: self.run_id, node_memory.ROOT_ENV: str(host_memory(name))}
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
            node_memory.drop_run(self.run_id, host_memory(host.name))  # a node's memory goes with it

    def shutdown(self) -> None:
        with self.lock:
            self._closed.set()
            procs, self.procs = list(self.procs.values()), {}
        for proc in procs:
            _kill_tree(proc)
        reap_run(self.run_id)


def host_memory(name: str):
    """A local host's node memory: its own folder, as each real node has its own RAM; the
    same name (a run's hosts are local-0, local-1, ... each time) finds it again."""
    return node_memory.root() / "local-hosts" / name


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


