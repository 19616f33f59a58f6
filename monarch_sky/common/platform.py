"""Which accelerator this process has, and the few shims TorchTitan needs on CPU.

Everything platform-specific lives here: the rest of monarch_sky asks `detect()` what it
runs on and calls `prepare_torchtitan()` before importing torchtitan.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    kind: str  # "rocm" | "cuda" | "cpu"
    backend: str  # torch.distributed backend inside a replica group
    device_count: int
    device_names: tuple[str, ...]
    version: str  # ROCm/HIP or CUDA version, "" on CPU

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


def detect() -> Platform:
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = tuple(torch.cuda.get_device_name(i) for i in range(count))
        if torch.version.hip:
            # On ROCm, "nccl" is RCCL.
            return Platform("rocm", "nccl", count, names, torch.version.hip)
        return Platform("cuda", "nccl", count, names, torch.version.cuda or "")
    return Platform("cpu", "gloo", 0, (), "")


class _CpuDeviceModule:
    """torch.cpu plus the CUDA-style memory calls TorchTitan's memory monitor makes."""

    def __getattr__(self, name):
        import torch

        return getattr(torch.cpu, name)

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None):
        import psutil

        return _CpuProperties(total_memory=psutil.virtual_memory().total)

    def memory_stats(self, device=None) -> dict:
        return {}

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


@dataclass(frozen=True)
class _CpuProperties:
    total_memory: int
    name: str = "cpu"


@contextlib.contextmanager
def _patched(obj, **attrs):
    saved = {name: getattr(obj, name) for name in attrs}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def prepare_torchtitan(platform: Platform) -> None:
    """Apply the CPU shims; must run before the first torchtitan import in a process.

    TorchTitan probes the accelerator when `torchtitan.tools.utils` is imported and falls
    back to "cuda" when there is none. On CPU we let that probe answer "cpu" with a device
    module that also has the memory-statistics calls its metrics expect.
    """
    if not platform.is_cpu or "torchtitan.tools.utils" in sys.modules:
        return
    import torch._utils

    cpu_module = _CpuDeviceModule()
    with _patched(
        torch._utils,
        _get_available_device_type=lambda: "cpu",
        _get_device_module=lambda device_type=None: cpu_module,
    ):
        import torchtitan.tools.utils  # noqa: F401


def set_spmd_backend(config) -> None:
    """TorchTitan's Trainer sets its SPMD backend from `parallelism.spmd_backend`; its TorchFT
    trainer (0.3.0) does not, so tensor parallelism's loss fails its backend check. Set it here."""
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)


ADVERTISE_ENV = "MONARCH_SKY_ADVERTISE_HOST"


def advertise_host() -> None:
    """Make this process name itself by the address the controller reaches its host on.

    TorchFT gives peers `socket.gethostname()` (its manager address, the checkpoint URL a
    rejoining group fetches weights from). Container and VM hostnames often do not resolve
    on the other nodes. Must run before torchft is imported: a default argument there reads
    the hostname at import time.
    """
    host = os.environ.get(ADVERTISE_ENV)
    if host:
        socket.gethostname = lambda: host




def cross_group_link(kind: str, environ=os.environ) -> str:
    """How this host's group reaches the other groups (TorchFT's all-reduce, the heal): RCCL
    or NCCL over RDMA unless `doctor` found none on the node and set NCCL_IB_DISABLE=1."""
    if kind == "cpu":
        return "gloo over TCP"
    if environ.get("NCCL_IB_DISABLE", "0") == "1":
        return "TCP sockets (NCCL_IB_DISABLE=1: no usable RDMA on this node)"
    return "RDMA where RCCL finds it"


def cpu_thread_env() -> dict[str, str]:
    """Environment for trainer processes: one math thread each, since several share a host."""
    return {"OMP_NUM_THREADS": os.environ.get("MONARCH_SKY_OMP_THREADS", "1")}


def host_has_gpu_devices(dev: str = "/dev") -> bool:
    """Whether this host exposes an AMD (kfd) or NVIDIA GPU, asked without importing torch."""
    return os.path.exists(os.path.join(dev, "kfd")) or os.path.exists(os.path.join(dev, "nvidiactl"))


def worker_thread_env() -> None:
    """Give a CPU host's trainers `cpu_thread_env` from their start: the host's worker sets it
    in its own environment, which the processes it spawns inherit. OpenMP reads it when torch
    loads; set only later (`limit_cpu_threads`), it came too late for that."""
    if not host_has_gpu_devices():
        for key, value in cpu_thread_env().items():
            os.environ.setdefault(key, value)


def limit_cpu_threads(platform: Platform) -> None:
    """Apply `cpu_thread_env` from inside a trainer process, once it knows its own platform
    (the controller's host may be a CPU node while the trainers' hosts have GPUs)."""
    if not platform.is_cpu:
        return
    import torch

    threads = cpu_thread_env()["OMP_NUM_THREADS"]
    os.environ["OMP_NUM_THREADS"] = threads
    torch.set_num_threads(int(threads))


def force_sum_reduction(model_parts) -> None:
    """gloo has no PREMUL_SUM, which FSDP uses to divide gradients in the reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule

    for model in model_parts:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def keep_kernels_on_node(home: str | None = None) -> str:
    """Keep what Inductor compiles (FlexAttention's tuned kernels on GPUs) in one folder per
    node that outlives a process and a reboot, so a respawned group or a promoted spare loads
    its kernels instead of tuning them again (Inductor's default, /tmp, is lost at a reboot).
    A folder the user set is kept. Must run before the first compile in the process."""
    if not os.environ.get(INDUCTOR_CACHE_ENV):
        os.environ[INDUCTOR_CACHE_ENV] = os.path.join(home or os.path.expanduser("~"), ".cache", "monarch-sky", "inductor")
    return os.environ[INDUCTOR_CACHE_ENV]



def close_links_on_error(manager) -> None:
    """Drop the cross-group process group at a step's first error, not at the next quorum.

    gloo keeps a failed group's connections open while any reference to it lives, and its
    abort() does not close them (torch 2.13, measured): a survivor that was not the dead
    group's ring neighbour waits in recv for `ft.process_group_timeout_ms`, and the next quorum
    waits for it. Freed, the connections close and that survivor's wait fails at once (20 ms
    against 10 s with 4 gloo ranks, measured). TorchFT builds a new group at the next quorum,
    as after any failed commit (its lighthouse bumps the quorum id when a member reports one).
    The group is freed off gloo's own threads, whose destructor joins them. Call it on the
    thread that trains.

    gloo only: whether NCCL/RCCL's survivors wait the same way, and whether an early abort
    releases them, is not measured (one GPU cannot run two NCCL ranks)."""
    report, trainer_thread = manager.report_error, threading.current_thread()

    def report_error(e: Exception) -> None:
        first = manager.errored() is None
        report(e)
        if first:
            group = manager._pg  # torchft's reconfigurable wrapper; `_pg` is its current group
            failed = group._pg
            if threading.current_thread() is trainer_thread:  # it waits on the step's collectives
                _free(group, failed)
            else:
                threading.Thread(target=_free, args=(group, failed), daemon=True).start()

    manager.report_error = report_error


def _free(group, failed) -> None:
    # Reference counting frees the group once the wrapper lets go (measured). No gc.collect():
    # a full collection holds the GIL for 0.6-1.5 s in a trainer (500k objects, 2 busy cores),
    # long enough for the controller to call a healthy survivor hung.
    if failed is not None and group._pg is failed:  # not one the next quorum built meanwhile
        group.abort()


def copies_beside_the_step():
    """Called on the training thread: a context for another thread's device-to-host copies of
    the tensors as they are now. On a GPU, a stream of their own that first waits for the work
    queued so far, so the copies overlap the next step's compute instead of queueing behind it
    on the default stream (not run here: no GPU). On CPU, nothing to do."""
    import torch

    if not torch.cuda.is_available():
        return contextlib.nullcontext
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return lambda: torch.cuda.stream(stream)


def quick_rendezvous(manager, rendezvous_s: float) -> None:
    """A cross-group gloo group waits at most `rendezvous_s` for its peers at each quorum's
    rendezvous; its collectives keep `ft.process_group_timeout_ms`.

    TorchFT builds the group anew at every quorum change, and gloo builds it with one timeout
    for both: when a member of the new quorum dies before joining (a rejoiner killed during
    its heal), every survivor waits out the whole collective timeout in the store rendezvous,
    on TorchFT's quorum thread, before the step fails and the next quorum leaves the dead member
    out. gloo only, like `close_links_on_error`."""
    from datetime import timedelta

    import torch

    group, configure = manager._pg, manager._pg.configure
    short = timedelta(seconds=rendezvous_s)

    def configure_quickly(*args, **kwargs) -> None:
        full = group._timeout
        group._timeout = min(full, short)
        try:
            configure(*args, **kwargs)
        finally:
            group._timeout = full
        if group._pg is not None:
            group._pg._get_backend(torch.device("cpu")).set_timeout(full)  # the collectives' own

    group.configure = configure_quickly


def upstream_ports(manager) -> list[int]:
    """The ports of upstream's listeners on every interface in this rank (docs/security.md):
    the group's TCPStore (MASTER_PORT, set by Monarch's SPMD setup; rank 0 holds it) and
    torchft 0.2.0's ManagerServer (group rank 0, bound to [::]; no public accessor)."""
    ports = [int(os.environ["MASTER_PORT"])] if os.environ.get("MASTER_PORT") else []
    server = getattr(manager, "_manager", None)
    if server is not None:
        ports.append(int(server.address().rsplit(":", 1)[1]))
    return ports
