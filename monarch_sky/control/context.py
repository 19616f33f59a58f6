"""What every part of one run shares: settings, services and the live generations.

The controller builds one `RunContext`; slots, the detector and the injector read it. It
holds no logic beyond building what a replica group needs to start (its spec, its process
environment) and calling a provider without letting it hold the process open.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from monarch_sky.common import hub_assets

from monarch_sky.common import platform as platform_mod
from monarch_sky.hosts import lighthouse_gate
from monarch_sky.hosts.base import Host
from monarch_sky.recipes import TrainerSpec
from monarch_sky.replica.heal_wire import HEAL_SECRET_ENV


@dataclass
class RunContext:
    cfg: Any  # the validated job config
    provider: Any  # HostProvider
    record: Any  # RunRecord
    tracker: Any  # Tracker
    display: Any  # Display
    platform: platform_mod.Platform  # the controller's own host
    injector: Any = None  # FaultInjector
    ledger: Any = None  # StepLedger
    data_history: Any = None  # ledger.DataHistory: each group's recent data positions
    memory: Any = None  # memory_restore.NodeMemory: the run's state in node memory
    router: Any = None  # supervision.FailureRouter
    checkpoints: Any = None  # checkpoint_policy.CheckpointPolicy
    spares: Any = None  # spares.SparePool
    lighthouse_address: str = ""
    lighthouse_gated: bool = False  # behind lighthouse_gate's mutual TLS: trainers dial it through a door
    heal_transport: str = ""  # the one every trainer of the run uses (`ft.heal_transport` resolved)
    replica_platform: str = ""  # what the first replica group reported ("rocm x8", "cpu")
    cross_group: list[str] = field(default_factory=list)  # how groups reached each other (platform.cross_group_link)
    standbys_seen: set[int] = field(default_factory=set)  # groups whose first standby said it was ready
    initial_loads: dict[str, Any] = field(default_factory=dict)  # replica -> the released weights it loaded (seconds, digest)
    groups: dict[str, Any] = field(default_factory=dict)  # owner -> live ReplicaGroup (standbys too)
    slots: list[Any] = field(default_factory=list)  # one Slot per replica group
    lost: list[dict[str, Any]] = field(default_factory=list)
    unplanned: list[dict[str, Any]] = field(default_factory=list)
    progress_lost: list[dict[str, Any]] = field(default_factory=list)  # every state holder failed at once
    background: set[asyncio.Task] = field(default_factory=set)
    finishing: bool = False  # some group reached the target: no more respawns
    last_failure_at: float = 0.0  # when the latest failure of any group was detected
    loop_thread: int | None = None  # the controller's event loop's: the only one that changes a slot
    start_time: float = field(default_factory=time.monotonic)

    def phase(self, text: str) -> None:
        self.display.line(f"[{time.monotonic() - self.start_time:6.1f}s] {text}")

    def dump_folder(self, index: int) -> str:
        return str(self.record.path / "torchtitan" / f"replica_{index}")

    def spec(self, index: int, resume: Any = None, restore_step: int | None = None, rejoining: bool = False) -> TrainerSpec:
        """Group `index`'s trainer spec; `resume`: a checkpoint (`checkpoints.Found`) to load at
        setup; `restore_step`: a step to load from its hosts' node memory instead. A group that
        joins after a commit heals from a peer, so it skips the released weights."""
        checkpoint = self.checkpoints.spec_for(index, resume) if self.checkpoints is not None else None
        spec = TrainerSpec.from_job(self.cfg, index, self.dump_folder(index), checkpoint=checkpoint,  # platform: the host's own
                                    restore_step=restore_step)
        return replace(spec, init_weights=None) if rejoining and self.ledger.run_step > 0 else spec

    def refuse_platform(self, platform: str) -> str | None:
        """Why a group on `platform` may not train, or None. Every group must have the same
        accelerators (TorchFT's cross-group collectives and FSDP's shard shapes must match):
        the first group to start sets them."""
        if not self.replica_platform:
            self.replica_platform = platform
        elif platform != self.replica_platform:
            return f"its host has {platform}, the other groups {self.replica_platform}; every group needs the same accelerators"
        return None

    def note_standby_ready(self, index: int, generation: int, seconds: float) -> None:
        """A group's standby finished warming (in the background, while the group trains)."""
        self.record.event("standby_ready", replica=index, generation=generation, seconds=round(seconds, 3))
        if index not in self.standbys_seen:
            self.standbys_seen.add(index)
            self.phase(f"[replica {index}] standby ready ({seconds:.1f}s, warmed while training)")

    def note_group_started(self, index: int, info: dict[str, Any]) -> None:
        """What a group's hosts said as it started: how it reaches the others, whether it sees
        the checkpoint folder."""
        self._note_cross_group(index, info.get("cross_group", ""))
        if loaded := info.get("initial_weights"):
            self.initial_loads[str(index)] = {"seconds": loaded["seconds"], "digest": loaded["digest"]}
            self.record.event("initial_weights", replica=index, **loaded)
        self.checkpoints.check_seen(index, info.get("checkpoint_folder_seen"))

    def _note_cross_group(self, index: int, link: str) -> None:
        """Say loudly, once per link, when a GPU group's cross-group traffic falls back to TCP."""
        if link in self.cross_group:
            return
        self.cross_group.append(link)
        self.record.event("cross_group_link", replica=index, link=link)
        if link.startswith("TCP"):
            self.display.line(f"monarch-sky: WARNING: replica {index}'s cross-group all-reduce and heals run over {link}; "
                              "far slower than RDMA (docs/kubernetes.md says how to give nodes RDMA)")

    def proc_env(self, hosts: list[Host]) -> dict[str, str]:
        """One environment for every process of a group. A group on several hosts leaves
        the address each advertises to its host's worker (`monarch_sky.hosts.worker`)."""
        advertise = {platform_mod.ADVERTISE_ENV: hosts[0].ip} if len(hosts) == 1 else {}
        return {
            "TORCHFT_LIGHTHOUSE": self.lighthouse_address,
            **({lighthouse_gate.GATED_ENV: "1"} if self.lighthouse_gated else {}),
            **advertise,
            "PYTHONUNBUFFERED": "1",
            **trainer_env(self.cfg),  # the trainer sets its CPU threads itself (platform.limit_cpu_threads)
        }

    async def provider_call(self, fn: Callable[..., Any], *args: Any, what: str) -> None:
        """A provider call whose failure is recorded and shown, never swallowed."""
        try:
            await asyncio.wait_for(off_loop(fn, *args), self.cfg.timeouts.stop_s)
        except Exception as e:
            error = "timed out" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
            self.record.event("provider_error", action=what, error=error)
            self.display.line(f"monarch-sky: {what} failed: {error}")

    def watch_group(self, group) -> None:
        """Attribute Monarch supervision failures of `group`'s meshes to it (owner name)."""
        self.groups[group.owner] = group
        self.router.watch(group.owner)

    def forget_group(self, group) -> None:
        """No more failures, shutdown or standby duty for `group`."""
        self.router.unwatch(group.owner)
        self.groups.pop(group.owner, None)

    def in_background(self, coro) -> asyncio.Task:
        """Run `coro` on its own; shutdown cancels it. Its errors are logged, not raised."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self._finished)
        return task

    def keep(self, task: asyncio.Future) -> None:
        """A task nobody awaits any more (often cancelled, its cleanup still running): shutdown
        cancels and waits for it with the rest of the background."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _finished(self, task: asyncio.Task) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.record.event("background_error", error=f"{type(task.exception()).__name__}: {task.exception()}")


# This controller's run: a heal server answers only a peer that proves it holds this secret.
HEAL_SECRET = secrets.token_hex(32)


def trainer_env(cfg, platform=None) -> dict[str, str]:
    """What every trainer process of a job needs in its environment (the bench's arms too,
    which also pass their local `platform` for its CPU thread policy)."""
    env = {
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
        HEAL_SECRET_ENV: HEAL_SECRET,
        "TORCHFT_QUORUM_TIMEOUT_SEC": str(cfg.ft.quorum_timeout_s),
        "TORCHFT_TIMEOUT_SEC": str(cfg.ft.timeout_s),
    }
    if hub_assets.offline(cfg.data):  # local data: nothing may reach for the hub
        env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if platform is not None and platform.is_cpu:
        env.update(platform_mod.cpu_thread_env())
    return env


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking call (a provider's) in a daemon thread.

    Unlike `asyncio.to_thread`, a call still running when the run ends (a `sky launch` that
    takes 30 minutes) never holds the process open: the interpreter does not wait for
    daemon threads, and cancelling the await stops waiting for it at once.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():
            setter(value)

    def deliver(setter, value) -> None:
        try:
            loop.call_soon_threadsafe(settle, setter, value)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            deliver(future.set_exception, e)
        else:
            deliver(future.set_result, result)

    threading.Thread(target=work, name=f"provider-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future
