"""`sky/bootstrap.sh` on one simulated node: its exit codes, its one-controller lock, which
workers it adopts; and the RCCL/gloo environment it applies (`monarch_sky.hosts.doctor.rccl_env`),
against fake sysfs and /dev trees (MONARCH_SKY_SYSFS, MONARCH_SKY_DEV)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, cli_env, leftovers, new_tag
from monarch_sky.hosts import doctor

BOOTSTRAP = REPO / "sky" / "bootstrap.sh"
EX_REPLACE_HOST = 75


# --- fake RDMA trees ------------------------------------------------------------------

def fake_hca(sysfs: Path, name: str, driver: str, state: str = "4: ACTIVE", link_layer: str = "InfiniBand") -> None:
    """/sys/class/infiniband/NAME as the kernel lays it out: port 1, and the device's driver link."""
    port = sysfs / "class" / "infiniband" / name / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text(link_layer + "\n")
    drivers = sysfs / "bus" / "pci" / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    (sysfs / "class" / "infiniband" / name / "device").mkdir()
    (sysfs / "class" / "infiniband" / name / "device" / "driver").symlink_to(drivers)


def fake_uverbs(dev: Path) -> None:
    (dev / "infiniband").mkdir(parents=True)
    (dev / "infiniband" / "uverbs0").touch()


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    sysfs.mkdir()
    dev.mkdir()
    return sysfs, dev


# --- the environment ---------------------------------------------------------------

def test_adapters_in_sysfs_without_device_files_mean_sockets_only(roots):
    sysfs, dev = roots  # a Kubernetes pod: the host's HCAs show, /dev/infiniband is not mounted
    fake_hca(sysfs, "mlx5_0", "mlx5_core")
    env, fabric = doctor.rccl_env("127.0.0.1", str(sysfs), str(dev), environ={})
    assert env["NCCL_IB_DISABLE"] == "1"
    assert [(h.name, h.driver, h.active) for h in fabric.hcas] == [("mlx5_0", "mlx5_core", True)]
    assert not fabric.rdma_usable and "no RDMA device mounts" in fabric.rdma_verdict()
    assert f"warn rdma-devices {dev}/infiniband: does not exist" in map(str, doctor.fabric_checks(fabric, {}))


@pytest.mark.parametrize("state, usable", [("4: ACTIVE", True), ("1: DOWN", False)])
def test_rdma_is_used_only_with_device_files_and_an_active_port(roots, state, usable):
    sysfs, dev = roots
    fake_hca(sysfs, "ionic_0", "ionic", state=state, link_layer="Ethernet")
    fake_uverbs(dev)
    env, fabric = doctor.rccl_env("127.0.0.1", str(sysfs), str(dev), environ={})
    assert fabric.rdma_usable is usable
    assert ("NCCL_IB_DISABLE" not in env) is usable
    assert env["HSA_NO_SCRATCH_RECLAIM"] == "1"
    assert f"ok   rdma-devices {dev}/infiniband: uverbs0" in map(str, doctor.fabric_checks(fabric, {}))
    [heal] = [c for c in doctor.fabric_checks(fabric, {}) if c.name == "heal-transport"]
    assert f"heal_transport=auto: {'rdma' if usable else 'tcp'}" in heal.detail and "TCP on lo" in heal.detail


def test_preset_settings_are_kept(roots):
    sysfs, dev = roots  # e.g. SkyPilot's OCI RoCE settings
    preset = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5"}
    env, _ = doctor.rccl_env("127.0.0.1", str(sysfs), str(dev), environ=preset)
    assert not set(env) & set(preset)
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # what is not preset is still filled in


def test_the_interface_is_found_without_the_ip_command(tmp_path):
    assert shutil.which("ip", path=str(tmp_path)) is None
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_sky.hosts.doctor", "--print-env", "127.0.0.1"],
        cwd=REPO, env={**cli_env(), "PATH": str(tmp_path), "NCCL_IB_HCA": "mlx5"},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "export NCCL_SOCKET_IFNAME=lo" in lines and "export GLOO_SOCKET_IFNAME=lo" in lines
    assert "export NCCL_IB_DISABLE=1" in lines  # this machine has no RDMA
    assert "kept preset NCCL_IB_HCA=mlx5" in proc.stderr


@pytest.mark.skipif(shutil.which("ip") is None, reason="no `ip` command here")
def test_the_ip_command_is_the_fallback_without_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    assert doctor.interface_for("127.0.0.1") == "lo"
    assert doctor.interface_for("192.0.2.1") is None  # TEST-NET-1: on no interface


def test_doctor_reports_each_adapter_the_device_files_and_the_settings(roots):
    sysfs, dev = roots
    fake_hca(sysfs, "mlx5_0", "mlx5_core")
    fake_hca(sysfs, "bnxt_re0", "bnxt_en", state="1: DOWN", link_layer="Ethernet")
    lines = [str(c) for c in doctor.fabric_checks(doctor.find_fabric(None, str(sysfs), str(dev)),
                                                   {"NCCL_IB_DISABLE": "1", "HSA_NO_SCRATCH_RECLAIM": "1", "PATH": "/bin"})]
    assert "ok   hca          mlx5_0: driver mlx5_core, port 1 ACTIVE InfiniBand" in lines
    assert "warn hca          bnxt_re0: driver bnxt_en, port 1 DOWN Ethernet" in lines
    assert f"warn rdma-devices {dev}/infiniband: does not exist" in lines
    assert "ok   env          HSA_NO_SCRATCH_RECLAIM=1 NCCL_IB_DISABLE=1" in lines


# --- the bootstrap on one simulated node ------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(tag: str, tmp: Path, role: str, port: int, **extra: str) -> dict[str, str]:
    """What SkyPilot gives a one-node task, as tests/hosts/test_sky.py's `bootstrap_env` does."""
    return {
        **cli_env(tag),
        "MONARCH_SKY_ROLE": role,
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "SKYPILOT_TASK_ID": tag,
        "RECIPE": "llama3_tiny",
        "PROCS_PER_REPLICA": "1",
        "WORKER_PORT": str(port),
        "MONARCH_SKY_PY": sys.executable,
        "MONARCH_SKY_STATE": str(tmp / "state"),
        **extra,
    }


class Node:
    """A bootstrap run in the background, its output in a file."""

    def __init__(self, env: dict[str, str], log: Path):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["bash", str(BOOTSTRAP)], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output:
            assert self.proc.poll() is None, f"bootstrap exited {self.proc.returncode} before '{text}':\n{self.output}"
            assert time.monotonic() < deadline, f"no '{text}' within {timeout_s}s:\n{self.output}"
            time.sleep(0.5)

    def finish(self, timeout_s: float = 60) -> int:
        return self.proc.wait(timeout=timeout_s)


def tagged_cmdlines(tag: str) -> list[list[str]]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("MONARCH_SKY_TEST_TAG") == tag:
                found.append(p.cmdline())
        except (psutil.Error, OSError):
            pass
    return found


def kill_tagged(tag: str) -> None:
    """SIGKILL what a test started (every process carrying its tag), if anything is left."""
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("MONARCH_SKY_TEST_TAG") == tag:
                p.kill()
        except (psutil.Error, OSError):
            pass


def worker_pid(state: Path, port: int) -> int:
    return int((state / f"worker-{port}.pid").read_text())


def test_a_killed_worker_fails_its_node_and_the_bootstrap_that_adopted_it(tmp_path, roots):
    sysfs, dev = roots
    fake_hca(sysfs, "mlx5_0", "mlx5_core")  # seen, but not mounted: sockets only
    tag, port = new_tag(), free_port()
    env = node_env(tag, tmp_path, "worker", port, MONARCH_SKY_SYSFS=str(sysfs), MONARCH_SKY_DEV=str(dev),
                   WORKER_RESTARTS="0")  # the default restarts it: see the test below
    try:
        first = Node(env, tmp_path / "first.log")
        first.wait_for("serving until the controller finishes")
        pid = worker_pid(tmp_path / "state", port)
        second = Node(env, tmp_path / "second.log")  # e.g. `sky exec` again on the live node
        second.wait_for("serving until the controller finishes")
        assert f"worker on port {port} already running (pid {pid})" in second.output
        assert worker_pid(tmp_path / "state", port) == pid  # adopted, not doubled
        os.kill(pid, signal.SIGKILL)
        assert first.finish() == 128 + signal.SIGKILL, first.output
        assert second.finish() == 128 + signal.SIGKILL, second.output
    finally:
        kill_tagged(tag)
    assert f"worker on port {port} exited with status 137" in first.output
    assert f"(pid {pid}, adopted) exited with status 137" in second.output
    # The doctor reports the adapter and the settings this bootstrap chose.
    assert "[node 0 doctor] ok   hca          mlx5_0: driver mlx5_core, port 1 ACTIVE InfiniBand" in first.output
    env_line = next(line for line in first.output.splitlines() if line.startswith("[node 0 doctor] ok   env"))
    assert "NCCL_IB_DISABLE=1" in env_line and "NCCL_SOCKET_IFNAME=lo" in env_line and "GLOO_SOCKET_IFNAME=lo" in env_line
    assert leftovers(tag) == []


def test_a_cluster_node_whose_worker_dies_for_good_does_not_fail_the_others(tmp_path):
    # One node's non-zero run makes SkyPilot cancel every node's run (Ray's driver,
    # backends/task_codegen.py; Slurm's srun --kill-on-bad-exit), which would end a run the
    # controller goes on with. Node 1 of two: node 0 (nothing at 127.0.0.2) never answered,
    # so its standby stays out of the way.
    tag, port = new_tag(), free_port()
    # Resuming a run on a new cluster (docs/cloud.md): its run id and RUN_DIR win over the task id.
    env = node_env(tag, tmp_path, "cluster", port, SKYPILOT_NODE_RANK="1", SKYPILOT_NODE_IPS="127.0.0.2\n127.0.0.1",
                   SKYPILOT_NUM_NODES="2", WORKER_RESTARTS="0", RUN_DIR=str(tmp_path / "bucket"),
                   MONARCH_SKY_ARGS="run_id=llama-run-1 steps=500")
    try:
        node = Node(env, tmp_path / "node1.log")
        node.wait_for("standing by to take the run over")
        [words] = [cmdline for cmdline in tagged_cmdlines(tag) if "standby" in cmdline]
        run_ids = [w for w in words if w.startswith("run_id=")]
        assert run_ids[-1] == "run_id=llama-run-1" and f"run_dir={tmp_path / 'bucket'}" in words, words
        os.kill(worker_pid(tmp_path / "state", port), signal.SIGKILL)
        rc = node.finish(timeout_s=120)
    finally:
        kill_tagged(tag)
    assert rc == 0, node.output
    assert f"worker on port {port} exited with status 137" in node.output
    assert "its worker ended with status 137; the run goes on without it" in node.output
    assert leftovers(tag) == []


def test_a_pidfile_naming_another_process_is_not_adopted(tmp_path):
    tag, port = new_tag(), free_port()
    state = tmp_path / "state"
    state.mkdir()
    stranger = subprocess.Popen(["sleep", "300"])  # what a recycled pid could be
    (state / f"worker-{port}.pid").write_text(f"{stranger.pid}\n")
    try:
        node = Node(node_env(tag, tmp_path, "worker", port, WORKER_RESTARTS="0"), tmp_path / "node.log")
        node.wait_for("serving until the controller finishes")
        assert "which is no worker on port" in node.output and "already running" not in node.output
        pid = worker_pid(state, port)
        assert pid != stranger.pid and "monarch_sky" in " ".join(psutil.Process(pid).cmdline())
        assert stranger.poll() is None  # left alone
        os.kill(pid, signal.SIGKILL)
        assert node.finish() != 0, node.output
    finally:
        stranger.kill()
        stranger.wait(timeout=10)
        kill_tagged(tag)
    assert leftovers(tag) == []


@pytest.mark.parametrize("role", ["cluster", "controller"])
def test_a_second_controller_on_the_node_is_refused(tmp_path, role):
    state = tmp_path / "state"
    state.mkdir()
    with open(state / "controller.lock", "a") as lock:  # a controller holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242\n")
        lock.flush()
        proc = subprocess.run(
            ["bash", str(BOOTSTRAP)], cwd=REPO, env=node_env(new_tag(), tmp_path, role, free_port()),
            capture_output=True, text=True, timeout=60,
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "a controller already runs on this node (bootstrap pid 4242" in proc.stderr


def test_a_node_that_fails_its_preflight_asks_for_a_new_host(tmp_path):
    tag = new_tag()  # this CPU machine is told to have a GPU: torch sees none
    proc = subprocess.run(
        ["bash", str(BOOTSTRAP)], cwd=REPO,
        env=node_env(tag, tmp_path, "worker", free_port(), SKYPILOT_NUM_GPUS_PER_NODE="1"),
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == EX_REPLACE_HOST, proc.stdout + proc.stderr
    assert "FAIL gpus" in proc.stdout and "this host must be replaced" in proc.stderr
    assert leftovers(tag) == []


def test_a_worker_that_dies_comes_back_on_a_port_the_controller_can_attach_to(tmp_path):
    """Monarch 0.7.0 never re-attaches a controller to a new worker at a dead worker's address:
    the bootstrap starts it again COMEBACK_PORT_STEP higher, where AddressListHosts looks."""
    from monarch_sky.hosts.addresses import COMEBACK_PORT_STEP, AddressListHosts
    from monarch_sky.hosts.base import Host

    tag, port = new_tag(), free_port()
    moved = port + COMEBACK_PORT_STEP
    try:
        node = Node(node_env(tag, tmp_path, "worker", port, WORKER_RESTARTS="1"), tmp_path / "node.log")
        node.wait_for("serving until the controller finishes")
        os.kill(worker_pid(tmp_path / "state", port), signal.SIGKILL)
        node.wait_for(f"starting it again on port {moved} (1/1)")
        back = AddressListHosts([f"127.0.0.1:{port}"], "127.0.0.1", wait_s=60).replace(Host("node-0", "127.0.0.1", port))
        assert (back.ip, back.port) == ("127.0.0.1", moved)
        os.kill(worker_pid(tmp_path / "state", port), signal.SIGKILL)  # no restarts left: the node fails
        assert node.finish() == 128 + signal.SIGKILL, node.output
    finally:
        kill_tagged(tag)
    assert leftovers(tag) == []


@pytest.mark.parametrize("spares, nodes, per_group, says", [
    ("1", "1", "1", "SPARE_NODES=1 leaves none of the 1 nodes to train"),
    ("one", "2", "1", "SPARE_NODES=one must be a whole number"),
    ("1", "4", "2", "does not divide the 3 nodes left after SPARE_NODES=1"),
])
def test_spare_nodes_that_cannot_fit_the_cluster_are_refused_before_anything_starts(tmp_path, spares, nodes, per_group, says):
    env = node_env(new_tag(), tmp_path, "cluster", free_port(), SPARE_NODES=spares, HOSTS_PER_REPLICA=per_group,
                   SKYPILOT_NUM_NODES=nodes, SKYPILOT_NODE_IPS="\n".join(f"127.0.0.{i + 1}" for i in range(int(nodes))))
    proc = subprocess.run(["bash", str(BOOTSTRAP)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and says in proc.stderr, proc.stdout + proc.stderr
    assert list((tmp_path / "state").glob("worker-*")) == [], "no worker was started"
