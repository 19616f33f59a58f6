"""One rank's committed state in node memory (`monarch_sky.common.node_memory`), so the run
outlives its processes: the controller's loss, or every trainer crashing at once.

- What: exactly what a heal sends (TorchFT's user state and its step: `Manager._manager_state_dict`),
  plus this rank's data position, packed as `heal_wire` packs a heal: one file per snapshot,
  a JSON header and the tensors' bytes, mapped from /dev/shm.
- When: after a committed step whose progress is a multiple of `snapshot.every_steps` (DiLoCo:
  at such a sync). The copy runs on a thread while the next step computes; the next optimizer
  step waits for it (`wait`), since it is what changes the tensors being copied.
- Torn-write-proof: a snapshot is written under a hidden name and renamed when whole; a rank
  drops its older snapshots only once every rank of its group wrote the newer one (`confirm`,
  a MIN all-reduce inside the group), so some step is always complete for the whole group.
  At most two snapshots per rank exist, and only while one is being written.
- Served: a heal of the state the newest snapshot holds is served from it (`matching`): the
  snapshot is the serving copy, not a second one.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monarch_sky.common import node_memory, platform
from monarch_sky.common.checkpoints import encode
from monarch_sky.common.node_memory import MAGIC, PREFIX, data_offset, read_header
from monarch_sky.replica import heal_wire
from monarch_sky.replica.heal_wire import Packed

ROOM = 1.05  # a write needs this share of its size free in node memory


class NodeStateError(RuntimeError):
    """A snapshot could not be written or read (node memory full, a torn or foreign file)."""


@dataclass
class Snapshot:
    meta: dict  # step (TorchFT's: DiLoCo counts syncs), progress (the run's), version, data_state, ...
    path: Path
    packed: Packed  # what a heal serves: its wire header and bytes (a view of the file's mapping)

    @property
    def progress(self) -> int:
        return self.meta["progress"]


@dataclass
class SnapshotStats:
    taken: int = 0
    write_s: float = 0.0  # seconds the copies took, off the training thread
    wait_s: float = 0.0  # seconds the training thread waited for them
    nbytes: int = 0  # the newest snapshot's size
    errors: list[str] = field(default_factory=list)


def write(path: Path, partial: Path, state: Any, header: dict) -> Snapshot:
    """Write `state` whole to `path` (via `partial`); the mapping stays open for serving."""
    leaves, wire = heal_wire.describe(state, header["step"])
    head = json.dumps(encode({**header, **wire})).encode()
    start, nbytes = data_offset(len(head)), wire["nbytes"]
    if node_memory.free_bytes(path.parent) < ROOM * (start + nbytes):
        raise NodeStateError(f"node memory at {path.parent} has no room for a {start + nbytes} byte snapshot")
    try:
        with open(partial, "w+b") as f:
            f.truncate(start + nbytes)
            mapped = mmap.mmap(f.fileno(), start + nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        mapped[:PREFIX] = MAGIC + struct.pack("!Q", len(head))
        mapped[PREFIX:PREFIX + len(head)] = head
        buffer = _bytes(mapped, start, nbytes)
        heal_wire.fill(leaves, wire, buffer)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return Snapshot(header, path, Packed(wire, buffer))


def read(path: Path, mesh=None) -> tuple[dict, Any]:
    """(header, state) of a complete snapshot; the state's tensors are views of a private
    mapping of the file (copy-on-write: loading them copies nothing twice)."""
    try:
        header, start = read_header(path)
    except ValueError as e:
        raise NodeStateError(str(e)) from None
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), start + header["nbytes"], flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return header, heal_wire.unpack(header, _bytes(mapped, start, header["nbytes"]), mesh)


def _bytes(mapped: mmap.mmap, start: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mapped, dtype=torch.uint8, offset=start, count=nbytes)


class NodeState:
    """This rank's snapshots: `take` after a due commit, `wait` before the next optimizer step,
    `confirm` once in the step after a `take` (every rank of the group calls it then)."""

    def __init__(self, run_id: str, replica: int, rank: int, every_steps: int, unit_steps: int = 1):
        self.folder = node_memory.run_folder(run_id)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.replica, self.rank = replica, rank
        self.every = max(1, -(-every_steps // unit_steps)) * unit_steps if every_steps > 0 else 0
        self.stats = SnapshotStats()
        self.unconfirmed = False  # a snapshot was taken since the group last confirmed one
        self._lock = threading.Condition()
        self._writing: threading.Thread | None = None
        self._in_flight = False  # under `_lock`: a copy has started and not ended
        self._newest: Snapshot | None = None  # the newest this rank wrote
        self._error: str | None = None

    def due(self, progress: int, committed: bool) -> bool:
        return self.every > 0 and committed and progress > 0 and progress % self.every == 0

    def take(self, state: Any, step: int, progress: int, version: int, data_state: dict) -> None:
        """Copy `state` (committed step `step`) on a thread; the caller must not change it
        before `wait`."""
        self.wait()
        header = {"step": step, "progress": progress, "version": version, "replica": self.replica,
                  "rank": self.rank, "data_state": data_state, "wall": time.time()}
        self.unconfirmed = True
        with self._lock:
            self._in_flight = True
        beside = platform.copies_beside_the_step()
        self._writing = threading.Thread(target=self._write, args=(state, header, beside), name="node-state",
                                         daemon=True)
        self._writing.start()

    def _write(self, state: Any, header: dict, beside) -> None:
        began = time.perf_counter()
        name = (self.replica, self.rank, header["progress"])
        try:
            with beside():
                snap = write(self.folder / node_memory.snapshot_name(*name),
                             self.folder / node_memory.partial_name(*name), state, header)
        except (OSError, NodeStateError, heal_wire.HealWireError) as e:
            snap, error = None, f"{type(e).__name__}: {e}"
        with self._lock:  # the training thread takes the error (`take_error`) under the same lock
            if snap is None:
                self._error = error
            else:
                self._newest = snap
                self.stats.taken += 1
                self.stats.nbytes = snap.packed.nbytes
            self.stats.write_s += time.perf_counter() - began
            self._in_flight = False
            self._lock.notify_all()

    def wait(self) -> None:
        """Until the snapshot being written is whole (the training thread, before it changes
        the tensors)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            began = time.perf_counter()
            writing.join()
            self.stats.wait_s += time.perf_counter() - began

    def confirm(self, group_newest) -> None:
        """Drop this rank's snapshots older than the newest its whole group wrote;
        `group_newest(mine)` is that step (a MIN all-reduce over the group's ranks)."""
        self.wait()
        self.unconfirmed = False
        mine = self._newest.progress if self._newest is not None else -1
        keep_from = group_newest(mine)
        for group, rank, progress in node_memory.snapshots(self.folder):
            if (group, rank) == (self.replica, self.rank) and progress < keep_from:
                (self.folder / node_memory.snapshot_name(group, rank, progress)).unlink(missing_ok=True)

    def matching(self, version: int, timeout_s: float) -> Packed | None:
        """The snapshot of state `version`, for a heal (waits for its copy to finish); None
        if the newest snapshot holds another state."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._in_flight and time.monotonic() < deadline:
                self._lock.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            snap = self._newest
        return snap.packed if snap is not None and snap.meta["version"] == version else None

    def take_error(self) -> str | None:
        with self._lock:
            error, self._error = self._error, None
        if error:
            self.stats.errors.append(error)
        return error

    def load(self, progress: int, mesh=None) -> tuple[dict, Any]:
        """(header, state) of this rank's snapshot at `progress`, from its own node's memory
        (its group may have been another: every group holds the same state at a step)."""
        for group, rank, at in node_memory.snapshots(self.folder):
            if rank == self.rank and at == progress:
                return read(self.folder / node_memory.snapshot_name(group, rank, at), mesh)
        raise NodeStateError(f"no snapshot of rank {self.rank} at step {progress} in {self.folder}")

    def close(self) -> None:
        self.wait()


class TrainerSnapshots:
    """The trainer's side: when to copy, wait and confirm, and loading a snapshot at setup."""

    def __init__(self, store: NodeState, manager, device):
        self.store, self._manager, self._device = store, manager, device
        self._waited_s = 0.0  # the training thread's wait for copies, since the last step result
        self._reported_write_s = 0.0  # of the store's copy seconds, what step results already said

    @classmethod
    def of(cls, spec, rank: int, manager, device, unit_steps: int) -> "TrainerSnapshots | None":
        if not spec.run_id or not (spec.snapshot_every or spec.restore_step is not None):
            return None
        return cls(NodeState(spec.run_id, spec.replica, rank, spec.snapshot_every, unit_steps), manager, device)

    def before_update(self) -> None:
        """Before the optimizer changes the tensors a copy may still be reading."""
        began = time.perf_counter()
        self.store.wait()
        self._waited_s += time.perf_counter() - began

    def after_update(self, synced_commit: bool, progress: int, version: int, data_state: dict) -> None:
        """After a step's update and its bookkeeping: confirm the last snapshot, take one if due."""
        if self.store.unconfirmed:
            self.store.confirm(self._group_min)
        if self.store.due(progress, synced_commit):
            self.store.take(self._manager._manager_state_dict(), self._manager.current_step(), progress, version,
                            data_state)

    def _group_min(self, mine: int) -> int:
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return mine
        value = torch.tensor([mine], dtype=torch.int64, device=self._device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
        return int(value.item())

    def take_stats(self) -> dict:
        """The StepResult fields of the snapshots since the last step."""
        waited, self._waited_s = self._waited_s, 0.0
        written = self.store.stats.write_s - self._reported_write_s
        self._reported_write_s += written
        return {"memory_wait_s": waited, "memory_write_s": written, "memory_error": self.store.take_error() or ""}

    def restore(self, progress: int, mesh) -> tuple[dict, dict]:
        """Load this rank's snapshot at `progress` into what is registered with TorchFT now.
        Returns its data position and the state of the keys registered later (DiLoCo's
        fragments: `load_later` once its context is entered)."""
        header, state = self.store.load(progress, mesh)
        later = {}
        for key, value in state["user"].items():
            load = self._manager._load_state_dict_fns.get(key)  # torchft 0.2.0 has no public accessor
            if load is None:
                later[key] = value
            else:
                load(value)
        self._manager.load_state_dict(state["torchft"])
        own = header["replica"] == self.store.replica  # another group's position is not this one's shard's
        return (header["data_state"] if own else None), later

    def load_later(self, later: dict) -> None:
        for key, value in later.items():
            load = self._manager._load_state_dict_fns.get(key)
            if load is None:
                raise NodeStateError(f"the snapshot holds {key!r}, which this trainer does not register with TorchFT")
            load(value)

    def close(self) -> None:
        self.store.close()
