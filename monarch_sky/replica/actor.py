"""ReplicaActor: one per rank of a replica group's process mesh.

An actor mesh of ReplicaActors is one replica group: N processes (N GPUs) training one
model copy with FSDP, kept in step with the other groups by TorchFT. The controller calls
the mesh's endpoints (`warm`, `setup`, `step`, `save_checkpoint`, `final_state`, `close`); every
rank runs them together because the group's FSDP collectives need all of its ranks.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

from monarch.actor import Actor, endpoint

from monarch_sky.common import checkpoints, cpu_priority
from monarch_sky.common import platform as platform_mod
from monarch_sky.common import test_hooks
from monarch_sky.common.supervision import resolved
from monarch_sky.hosts import lighthouse_gate
from monarch_sky.recipes import TrainerSpec
from monarch_sky.replica import digest as digest_mod
from monarch_sky.replica.data_position import DataHandover
from monarch_sky.replica.step_result import StepResult, combine

log = logging.getLogger(__name__)


class ReplicaActor(Actor):
    """TorchFT finds the lighthouse through TORCHFT_LIGHTHOUSE in the process environment."""

    def __init__(self):
        self.spec: TrainerSpec | None = None  # the group's, given at setup (a spare's group is known only then)
        self.trainer = None

    @endpoint
    def warm(self) -> float:
        """Import torch, TorchFT and TorchTitan ahead of time; returns the seconds it took."""
        start = time.perf_counter()
        platform_mod.advertise_host()
        _quiet_logs()
        from monarch_sky.replica import trainer

        trainer.import_torchtitan()
        _keep_out_of_gc()
        return time.perf_counter() - start

    @endpoint
    def warm_up_step(self, spec: TrainerSpec, mode: str) -> float | None:
        """A spare's step on dummy data (`monarch_sky.replica.warm_up_step`); seconds, or None if skipped."""
        from monarch.actor import current_rank

        from monarch_sky.replica.warm_up_step import warm_up_step

        return warm_up_step(spec, mode, current_rank()["gpus"])

    @endpoint
    def setup(self, spec: TrainerSpec, rejoining: bool, data: DataHandover) -> dict:
        """Build the trainer (after `warm`); TorchFT joins the lighthouse on the first step.

        `rejoining`: the group joins a job already training, so it must heal from a peer.
        `data`: where the previous generation's kept training left each rank's data.
        """
        start = time.perf_counter()
        from monarch_sky.replica.trainer import GroupTrainer

        rank = int(os.environ["RANK"])  # set by the group's SPMD setup
        lighthouse_gate.open_door()  # before TorchFT's manager reads TORCHFT_LIGHTHOUSE
        self.spec = spec
        self.trainer = GroupTrainer(self.spec, rejoining, data, rank)
        test_hooks.leak_a_process(spec.replica, rank)
        plat = self.trainer.platform
        _keep_out_of_gc()
        cpu_priority.yield_cpu_to_recovery(plat.kind)
        return {
            "pid": os.getpid(), "step": self.trainer.progress(), "build_s": time.perf_counter() - start,
            "platform": f"{plat.kind} x{plat.device_count}" if plat.device_count else plat.kind,
            "cross_group": platform_mod.cross_group_link(plat.kind),
            "checkpoint_folder_seen": checkpoints.sees_probe(spec.checkpoint.probe if spec.checkpoint else None),
            "initial_weights": self.trainer.initial_weights,
            "upstream_ports": platform_mod.upstream_ports(self.trainer.manager),
        }

    @endpoint
    def step(self) -> StepResult:
        return self.trainer.step()

    @endpoint
    def join(self) -> StepResult:
        return self.trainer.join()

    @endpoint
    def inner_steps(self, count: int) -> list[StepResult]:
        return self.trainer.inner_steps(count)

    @endpoint
    def save_checkpoint(self, step: int) -> dict:
        return self.trainer.save_checkpoint(step)

    @endpoint
    def final_state(self) -> dict:
        return self.trainer.final_state()

    @endpoint
    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None


def _keep_out_of_gc() -> None:
    """What the imports and the build made lives as long as the process: the collection at exit
    walked it all (TorchTitan turns automatic GC off), 3.4 s per trainer on 2 cores, every stop."""
    gc.freeze()


def _quiet_logs() -> None:
    """TorchTitan and TorchFT log every step at INFO; the controller shows progress."""
    level = os.environ.get("MONARCH_SKY_TRAINER_LOG_LEVEL", "WARNING")
    for name in ("torchtitan", "torchft", "torchft.manager", "root"):
        logging.getLogger(name).setLevel(level)


class GroupFailed(RuntimeError):
    """The replica group cannot go on: a process died, a call raised, or a step hung."""


def _consume(task: asyncio.Future) -> None:
    """An abandoned call may still fail later; its error is already handled."""
    if not task.cancelled():
        task.exception()


class ReplicaGroup:
    """The controller's handle on one incarnation of a replica group.

    Generation g of replica r owns the actor meshes `r{r}g{g}-*`, which is how Monarch
    supervision failures are attributed to it (see `monarch_sky.common.supervision`). Its processes
    form a {hosts, gpus} mesh over the group's hosts; rank = host index x procs + gpu.
    """

    def __init__(self, index: int, generation: int, hosts: list, host_mesh, procs: int, owner: str = ""):
        self.index = index
        self.generation = generation
        self.hosts = list(hosts)
        self.host_mesh = host_mesh  # one HostMesh over all of `hosts`
        self.procs = procs  # per host
        self.owner = owner or f"r{index}g{generation}"  # a spare's keeps its own name once promoted
        self.failure: str | None = None
        self.detected = False  # the controller has recorded this group's failure
        self._failed = asyncio.Event()
        self.proc_mesh = None
        self.actors = None
        self.fault_actors = None
        self.timings: dict[str, float] = {}  # boot_s, import_s, warm_up_step_s (per rank, max), build_s
        self.pids: list[list[int]] = []  # per host, its ranks' pids, once spawned

    def mark_failed(self, report: str) -> None:
        if self.failure is None:
            self.failure = report
        self._failed.set()

    async def spawn(self, env: dict[str, str], timeout_s: float) -> None:
        """Start the group's processes and import the trainer code (a warm standby)."""
        from monarch.actor import default_bootstrap_cmd

        from monarch_sky.replica.fault_actor import FaultActor

        self.proc_mesh = self.host_mesh.spawn_procs(
            per_host={"gpus": self.procs},
            name=self.owner,
            bootstrap_command=default_bootstrap_cmd().with_env(env),
        )
        began = time.monotonic()
        self.fault_actors = self.proc_mesh.spawn(f"{self.owner}-fault", FaultActor)
        pids = await self._call(self.fault_actors.pid.call(), timeout_s)
        self.pids = [[] for _ in self.hosts]
        for point, pid in pids.items():
            self.pids[point["hosts"]].append(pid)
        self.timings["boot_s"] = round(time.monotonic() - began, 3)
        self.actors = self.proc_mesh.spawn(f"{self.owner}-replica", ReplicaActor)
        imports = await self._call(self.actors.warm.call(), timeout_s)
        self.timings["import_s"] = round(max(imports.values()), 3)

    async def warm_up_step(self, spec: TrainerSpec, mode: str, timeout_s: float) -> None:
        """A spare's warm-up step on every rank (`ReplicaActor.warm_up_step`)."""
        seconds = await self._call(self.actors.warm_up_step.call(spec, mode), timeout_s)
        ran = [s for s in seconds.values() if s is not None]
        if ran:
            self.timings["warm_up_step_s"] = round(max(ran), 3)

    async def setup(self, spec: TrainerSpec, rejoining: bool, data: DataHandover, timeout_s: float) -> dict:
        """Build the trainer on every rank; the group joins TorchFT on its first step."""
        from monarch.spmd import SPMDActor

        spmd = self.proc_mesh.spawn(f"{self.owner}-spmd", SPMDActor)
        # The TCPStore on rank 0 also carries TorchFT's cross-group process groups, so its
        # address must be the first host's reachable IP; the port is picked on that host.
        _, port = await self._call(spmd.slice(hosts=0, gpus=0).get_host_port.call_one(None), timeout_s)
        await self._call(spmd.setup_env.call(self.hosts[0].ip, port), timeout_s)
        per_rank = await self._call(self.actors.setup.call(spec, rejoining, data), timeout_s)
        info = per_rank.get(0)
        info["checkpoint_folder_seen"] = _all_seen([r["checkpoint_folder_seen"] for r in per_rank.values()])
        info["upstream_ports"] = sorted({port for r in per_rank.values() for port in r["upstream_ports"]})
        if info["initial_weights"] is not None:  # the group's digest of what its ranks loaded
            loads = [r["initial_weights"] for r in per_rank.values()]
            info["initial_weights"] = {**loads[0], "seconds": max(w["seconds"] for w in loads),
                                       "digest": digest_mod.combine([w["digest"] for w in loads])}
        self.timings["build_s"] = round(info["build_s"], 3)
        return info

    async def step(self, timeout_s: float) -> StepResult:
        return combine(list((await self._call(self.actors.step.call(), timeout_s)).values()))

    async def inner_steps(self, count: int, timeout_s: float) -> list[StepResult]:
        """DiLoCo: `count` inner steps in one call, each bounded by `timeout_s` (`GroupTrainer.inner_steps`)."""
        per_rank = (await self._call(self.actors.inner_steps.call(count), count * timeout_s)).values()
        return [combine(list(step)) for step in zip(*per_rank)]

    async def join(self, timeout_s: float) -> StepResult:
        """DiLoCo: heal at the other groups' next sync (see `GroupTrainer.join`)."""
        return combine(list((await self._call(self.actors.join.call(), timeout_s)).values()))

    async def save_checkpoint(self, step: int, timeout_s: float) -> dict:
        """Stage a checkpoint of committed step `step` on every rank (the writes go on in
        the background): the slowest rank's blocking seconds, and the first error if any."""
        per_rank = list((await self._call(self.actors.save_checkpoint.call(step), timeout_s)).values())
        errors = [r["error"] for r in per_rank if r["error"]]
        return {"blocking_s": max(r["blocking_s"] for r in per_rank), "error": errors[0] if errors else None}

    async def final_state(self, timeout_s: float) -> dict:
        """Rank 0's final state, with the group's digest combined from every rank's shards."""
        per_rank = list((await self._call(self.actors.final_state.call(), timeout_s)).values())
        return {**per_rank[0], "digest": digest_mod.combine([r["digest"] for r in per_rank])}

    async def answers(self, timeout_s: float) -> bool:
        """Whether every rank's process still runs Python: a hung one (GIL held, frozen)
        cannot answer, while a healthy one answers even in the middle of a long step."""
        try:
            await asyncio.wait_for(resolved(self.fault_actors.pid.call()), timeout_s)
            return True
        except Exception:
            return False

    def inject(self, kind: str, rank: int, delay_s: float) -> None:
        self.fault_actors.slice(hosts=rank // self.procs, gpus=rank % self.procs).inject.broadcast(kind, delay_s)

    def inject_when_serving(self, kind: str) -> None:
        """Each process fires `kind` as it begins to send its state to a rejoining peer."""
        self.fault_actors.inject_when_serving.broadcast(kind)

    async def close(self, timeout_s: float) -> None:
        """Let the trainers shut TorchFT down cleanly, then stop the processes."""
        began = time.monotonic()
        if self.actors is not None and self.failure is None:
            try:
                await self._call(self.actors.close.call(), timeout_s)
            except GroupFailed:
                pass
        closed = time.monotonic()
        await self.stop(timeout_s)
        log.info("%s closed: trainers %.2fs, processes %.2fs", self.owner, closed - began, time.monotonic() - closed)

    async def stop(self, timeout_s: float) -> None:
        if self.proc_mesh is None:
            return
        mesh, self.proc_mesh = self.proc_mesh, None
        try:
            await asyncio.wait_for(resolved(mesh.stop()), timeout_s)
        except Exception as e:  # a mesh with a dead process may refuse or hang
            log.warning("stopping %s: %s", self.owner, e)

    async def _call(self, future, timeout_s: float):
        """Await a Monarch call, giving up as soon as the group is known to have failed."""
        if self._failed.is_set():
            raise GroupFailed(self.failure)
        call = asyncio.ensure_future(resolved(future))
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({call, failed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not call.done():  # abandoned: it may still fail later, harmlessly
                call.add_done_callback(_consume)
                call.cancel()
        if call.done() and not call.cancelled():
            if call.exception() is None:
                return call.result()
            self.mark_failed(f"{type(call.exception()).__name__}: {call.exception()}")
        elif not self._failed.is_set():
            self.mark_failed(f"no answer within {timeout_s:.0f}s")
        raise GroupFailed(self.failure)


def _all_seen(seen: list) -> bool | None:
    """Whether every rank saw the checkpoint probe (None: there was none to see)."""
    return None if all(s is None for s in seen) else all(s is True for s in seen)
