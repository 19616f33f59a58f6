"""`monarch-sky doctor`: what this node has, and whether the other nodes answer.

Each check prints one line, `ok`, `warn` or `FAIL`, with what was found. The exit code is 1
when any check fails, so `sky/bootstrap.sh` can stop a broken node before training starts.

It also decides the node's RCCL/gloo environment (`rccl_env`), which the bootstrap applies
with `python -m monarch_sky.hosts.doctor --print-env MY_IP`. RDMA is used only when the container
can open it: Kubernetes pods see the host's HCAs in sysfs without the `/dev/infiniband`
device files, which SkyPilot mounts only in its RDMA network modes. A preset NCCL_* or
GLOO_* (SkyPilot sets NCCL_IB_HCA, NCCL_IB_GID_INDEX, NCCL_SOCKET_IFNAME on some clouds;
RCCL reads the NCCL_* names) always wins.
"""

from __future__ import annotations

import glob
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from monarch_sky.hosts.base import HostError, parse_address, reachable

ENV_PREFIXES = ("NCCL_", "GLOO_", "HSA_")  # the settings doctor reports


@dataclass
class Check:
    status: str  # ok | warn | FAIL
    name: str
    detail: str

    def __str__(self) -> str:
        return f"{self.status:<4} {self.name:<12} {self.detail}"


@dataclass
class Hca:
    """One RDMA adapter as sysfs shows it."""

    name: str  # mlx5_0, bnxt_re0, ionic_0, ...
    driver: str  # its device's kernel driver: mlx5_core, bnxt_en, ionic, ... ("?" if sysfs has no link)
    ports: dict[str, tuple[str, str]] = field(default_factory=dict)  # port -> (state, link layer)

    @property
    def active(self) -> bool:
        return any(state == "ACTIVE" for state, _ in self.ports.values())

    def __str__(self) -> str:
        ports = ", ".join(f"port {p} {state} {layer}" for p, (state, layer) in sorted(self.ports.items()))
        return f"{self.name}: driver {self.driver}, {ports or 'no ports'}"


@dataclass
class Fabric:
    """What the node offers collectives: its RDMA adapters, their device files, its interface."""

    hcas: list[Hca]
    dev_dir: str  # <dev>/infiniband
    uverbs: list[str]  # the uverbs* device files there: what RCCL opens to use an HCA
    iface: str | None  # the interface that holds this node's IP

    @property
    def rdma_usable(self) -> bool:
        return bool(self.uverbs) and any(h.active for h in self.hcas)

    def rdma_verdict(self) -> str:
        if not self.hcas:
            return "no RDMA adapters: collectives across nodes use TCP sockets"
        if not self.uverbs:
            return (f"{len(self.hcas)} adapter(s) in sysfs but no {self.dev_dir}/uverbs* (no RDMA device "
                    "mounts in this container): collectives across nodes use TCP sockets")
        if not any(h.active for h in self.hcas):
            return "no adapter port is ACTIVE: collectives across nodes use TCP sockets"
        return "RCCL may use " + ", ".join(h.name for h in self.hcas if h.active)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def find_hcas(sysfs: str = "/sys") -> list[Hca]:
    hcas = []
    for path in sorted(glob.glob(os.path.join(sysfs, "class", "infiniband", "*"))):
        try:
            driver = os.path.basename(os.readlink(os.path.join(path, "device", "driver")))
        except OSError:
            driver = "?"
        ports = {}
        for port in sorted(glob.glob(os.path.join(path, "ports", "*"))):
            state = _read(os.path.join(port, "state"))  # "4: ACTIVE"
            ports[os.path.basename(port)] = (state.partition(":")[2].strip() or state or "?",
                                             _read(os.path.join(port, "link_layer")) or "?")
        hcas.append(Hca(os.path.basename(path), driver, ports))
    return hcas


def interface_for(ip: str) -> str | None:
    """The network interface that holds `ip`: psutil, else `ip addr` (often absent in images)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == ip for a in addrs):
                return name
        return None
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():  # "2: eth0    inet 10.0.0.5/24 brd ..."
        words = line.split()
        if len(words) > 3 and words[3].split("/")[0] == ip:
            return words[1]
    return None


def find_fabric(my_ip: str | None, sysfs: str = "/sys", dev: str = "/dev") -> Fabric:
    dev_dir = os.path.join(dev, "infiniband")
    uverbs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(dev_dir, "uverbs*")))
    return Fabric(find_hcas(sysfs), dev_dir, uverbs, interface_for(my_ip) if my_ip else None)


def rccl_env(my_ip: str, sysfs: str = "/sys", dev: str = "/dev", environ=None) -> tuple[dict[str, str], Fabric]:
    """The RCCL/gloo settings this node needs that `environ` does not already set, and what was found."""
    environ = os.environ if environ is None else environ
    fabric = find_fabric(my_ip, sysfs, dev)
    wanted = {"HSA_NO_SCRATCH_RECLAIM": "1"}
    if fabric.iface:
        wanted |= {"NCCL_SOCKET_IFNAME": fabric.iface, "GLOO_SOCKET_IFNAME": fabric.iface}
    if not fabric.rdma_usable:
        wanted["NCCL_IB_DISABLE"] = "1"
    return {k: v for k, v in wanted.items() if not environ.get(k)}, fabric  # like `: "${K:=V}"`


def _roots() -> tuple[str, str]:
    """sysfs and /dev roots; tests point them at fake trees."""
    return os.environ.get("MONARCH_SKY_SYSFS", "/sys"), os.environ.get("MONARCH_SKY_DEV", "/dev")


def print_env(my_ip: str) -> int:
    """Shell `export` lines for the bootstrap's `eval`; what was found goes to stderr."""
    sysfs, dev = _roots()
    env, fabric = rccl_env(my_ip, sysfs, dev)

    def say(msg: str) -> None:
        print(f"monarch-sky bootstrap: {msg}", file=sys.stderr)

    say(f"RDMA: {fabric.rdma_verdict()}")
    if not fabric.iface:
        say(f"no interface holds {my_ip}; RCCL and gloo pick one themselves")
    kept = sorted(k for k in os.environ if k.startswith(ENV_PREFIXES))
    if kept:
        say("kept preset " + " ".join(f"{k}={os.environ[k]}" for k in kept))
    for key, value in sorted(env.items()):
        print(f"export {key}={shlex.quote(value)}")
    return 0


def platform_checks(expect_gpus: int | None) -> list[Check]:
    from monarch_sky.common import platform

    plat = platform.detect()
    checks = []
    if plat.is_cpu:
        checks.append(Check("ok", "platform", "CPU only: training uses gloo; right for tests and the tiny recipe, far too slow for real models"))
    else:
        checks.append(Check("ok", "platform", f"{plat.kind} {plat.version}, backend {plat.backend} ({'RCCL' if plat.kind == 'rocm' else 'NCCL'})"))
    names = ", ".join(sorted(set(plat.device_names))) or "none"
    checks.append(Check("ok", "gpus", f"{plat.device_count} ({names})"))
    if expect_gpus is not None and plat.device_count != expect_gpus:
        checks.append(Check("FAIL", "gpus", f"expected {expect_gpus} GPUs on this node, torch sees {plat.device_count}: check the image's ROCm torch and the device mounts (/dev/kfd, /dev/dri)"))
    checks.append(_collectives(plat))
    return checks + fabric_checks(find_fabric(None, *_roots()), os.environ)


def _collectives(plat) -> Check:
    import torch.distributed as dist

    if plat.is_cpu:
        return Check("ok" if dist.is_gloo_available() else "FAIL", "collectives", "gloo" if dist.is_gloo_available() else "gloo is missing from this torch build")
    if not dist.is_nccl_available():
        return Check("FAIL", "collectives", f"{'RCCL' if plat.kind == 'rocm' else 'NCCL'} is missing from this torch build")
    import torch

    version = ".".join(map(str, torch.cuda.nccl.version()))
    return Check("ok", "collectives", f"{'RCCL' if plat.kind == 'rocm' else 'NCCL'} {version}")


def heal_verdict(fabric: Fabric) -> str:
    """What `ft.heal_transport=auto` runs on this node (heal_transport.resolve asks Monarch itself)."""
    where = f"TCP on {fabric.iface}" if fabric.iface else "TCP"
    if fabric.rdma_usable:
        return ("heals (ft.heal_transport=auto: rdma) read a peer's snapshot through Monarch's RDMA buffers over "
                f"ibverbs (tcp over {where} if Monarch finds no ibverbs device); `make bench-heal` measures both")
    return (f"heals (ft.heal_transport=auto: tcp) run over {where}: no usable RDMA adapter, and Monarch's RDMA "
            "TCP fallback is slower than tcp; `make bench-heal` measures the rate against raw TCP")


def fabric_checks(fabric: Fabric, environ) -> list[Check]:
    """Each RDMA adapter, the device files, the verdict, and the NCCL_*/GLOO_*/HSA_* settings."""
    checks = [Check("ok" if h.active else "warn", "hca", str(h)) for h in fabric.hcas]
    found = ", ".join(fabric.uverbs) or ("no uverbs*" if os.path.isdir(fabric.dev_dir) else "does not exist")
    checks.append(Check("ok" if fabric.uverbs or not fabric.hcas else "warn", "rdma-devices", f"{fabric.dev_dir}: {found}"))
    checks.append(Check("ok" if fabric.rdma_usable else "warn", "rdma", fabric.rdma_verdict()))
    if not fabric.rdma_usable and environ.get("NCCL_IB_DISABLE", "0") != "1":
        checks.append(Check("warn", "rdma", "NCCL_IB_DISABLE is not 1 although RDMA is unusable: RCCL may try the adapters and fail"))
    checks.append(Check("ok", "heal-transport", heal_verdict(fabric)))
    settings = " ".join(f"{k}={environ[k]}" for k in sorted(environ) if k.startswith(ENV_PREFIXES))
    checks.append(Check("ok", "env", settings or "no NCCL_*, GLOO_* or HSA_* set: RCCL and gloo choose for themselves"))
    return checks


def reachability(targets: dict[str, tuple[str, int]], wait_s: float) -> list[Check]:
    """TCP-connect each (host, port); keep trying for `wait_s` before calling it down."""
    deadline = time.monotonic() + wait_s
    pending = dict(targets)
    checks = []
    while True:
        for name, (host, port) in list(pending.items()):
            if reachable(host, port):
                checks.append(Check("ok", name, f"{host}:{port} answers"))
                del pending[name]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    checks += [Check("FAIL", name, f"{host}:{port} does not answer (is its worker up? firewall?)") for name, (host, port) in pending.items()]
    return checks


def run(workers: list[str], lighthouse: str | None, expect_gpus: int | None, wait_s: float) -> int:
    checks = platform_checks(expect_gpus)
    targets: dict[str, tuple[str, int]] = {}
    for i, address in enumerate(workers):
        try:
            host = parse_address(address, name=f"node-{i}")
        except HostError as e:
            checks.append(Check("FAIL", f"node-{i}", str(e)))
            continue
        targets[f"node-{i}"] = (host.ip, host.port)
    if lighthouse:
        url = urlparse(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
        targets["lighthouse"] = (url.hostname or "", url.port or 29510)
    checks += reachability(targets, wait_s)
    for check in checks:
        print(check, flush=True)
    return 1 if any(c.status == "FAIL" for c in checks) else 0


if __name__ == "__main__":  # python -m monarch_sky.hosts.doctor --print-env MY_IP  (sky/bootstrap.sh)
    if len(sys.argv) != 3 or sys.argv[1] != "--print-env":
        sys.exit("usage: python -m monarch_sky.hosts.doctor --print-env MY_IP")
    sys.exit(print_env(sys.argv[2]))
