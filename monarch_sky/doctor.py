"""`monarch-sky doctor`: what this node has, and whether the other nodes answer.

Each check prints one line, `ok`, `warn` or `FAIL`, with what was found. The exit code is 1
when any check fails, so `sky/bootstrap.sh` can stop a broken node before training starts.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from monarch_sky.hosts import HostError, parse_address, reachable


@dataclass
class Check:
    status: str  # ok | warn | FAIL
    name: str
    detail: str

    def __str__(self) -> str:
        return f"{self.status:<4} {self.name:<12} {self.detail}"


def platform_checks(expect_gpus: int | None) -> list[Check]:
    from monarch_sky import platform

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
    checks.append(_rdma())
    return checks


def _collectives(plat) -> Check:
    import torch.distributed as dist

    if plat.is_cpu:
        return Check("ok" if dist.is_gloo_available() else "FAIL", "collectives", "gloo" if dist.is_gloo_available() else "gloo is missing from this torch build")
    if not dist.is_nccl_available():
        return Check("FAIL", "collectives", f"{'RCCL' if plat.kind == 'rocm' else 'NCCL'} is missing from this torch build")
    import torch

    version = ".".join(map(str, torch.cuda.nccl.version()))
    return Check("ok", "collectives", f"{'RCCL' if plat.kind == 'rocm' else 'NCCL'} {version}")


def _rdma() -> Check:
    devices = sorted(os.path.basename(p) for p in glob.glob("/sys/class/infiniband/*"))
    if devices:
        return Check("ok", "rdma", ", ".join(devices))
    return Check("warn", "rdma", "no RDMA devices: collectives across nodes go over TCP sockets")


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
