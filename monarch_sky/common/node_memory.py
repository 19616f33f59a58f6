"""Node memory: the run's training state kept on each node outside every process.

Monarch's worker ends a controller's processes when that controller goes (its procs are
stopped as orphans about a minute later), and a crash can take every trainer at once. What
lives in node memory survives both: each trainer rank keeps its latest committed state here
(`monarch_sky.replica.node_state`), and the controller notes beside it what only it knows
(every group's data position at that step, the faults it fired). A controller that comes back
under the same run id restores the run from any node that holds one group's complete state.

    <root>/<run_id>/g<G>-r<R>-s<S>.snap   rank R of group G at committed step S (header + bytes)
                   .g<G>-r<R>-s<S>.tmp    the same, still being written: never read
                   note-s<S>.json         the controller's note for step S (every group's data position)
                   run.json               the controller's note on the run (its step, the faults fired)
                   epoch                  the newest controller of the run that claimed this node
                                          ("EPOCH OWNER": two controllers that came up at once
                                          with one epoch are told apart by their owner token)

The root is `MONARCH_SKY_NODE_MEMORY` (the local provider gives each simulated host its own),
else /dev/shm (RAM, gone with the node, which is the point), else the temp folder. Nothing
here imports torch: the controller's agents read it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

from monarch_sky.common.checkpoints import decode, encode

ROOT_ENV = "MONARCH_SKY_NODE_MEMORY"
SNAPSHOT = re.compile(r"g(\d+)-r(\d+)-s(\d+)\.snap")
NOTE = re.compile(r"note-s(\d+)\.json")
EPOCH = "epoch"
RUN_NOTE = "run.json"
NOTES_KEPT = 3
# A snapshot file: MAGIC, the header's length (8 bytes), the JSON header, then from the next
# page on the tensors' bytes (`monarch_sky.replica.node_state` writes and loads them).
MAGIC = b"MSKYMEM1"
PREFIX = len(MAGIC) + 8
PAGE = 4096
HEADER_LIMIT = 64 << 20


def root() -> Path:
    """This node's memory for monarch-sky runs (per user: another user's runs are not ours)."""
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"monarch-sky-{os.getuid()}"


def run_folder(run_id: str, base: Path | None = None) -> Path:
    return (base or root()) / run_id


def snapshot_name(replica: int, rank: int, step: int) -> str:
    return f"g{replica}-r{rank}-s{step}.snap"


def partial_name(replica: int, rank: int, step: int) -> str:
    return f".g{replica}-r{rank}-s{step}.tmp"


def snapshots(folder: Path) -> list[tuple[int, int, int]]:
    """(group, rank, step) of every complete snapshot in a run's folder."""
    if not folder.is_dir():
        return []
    return sorted((int(m[1]), int(m[2]), int(m[3])) for p in folder.iterdir() if (m := SNAPSHOT.fullmatch(p.name)))


def data_offset(header_bytes: int) -> int:
    """Where a snapshot's tensor bytes start: the first page after its header."""
    return -(-(PREFIX + header_bytes) // PAGE) * PAGE


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A snapshot's header and the offset of its bytes; ValueError for a file that is not one
    or whose size does not match its header (a snapshot is renamed into place only whole)."""
    with open(path, "rb") as f:
        prefix = f.read(PREFIX)
        if len(prefix) < PREFIX or prefix[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{path} is not a monarch-sky snapshot")
        (length,) = struct.unpack("!Q", prefix[len(MAGIC):])
        if length > HEADER_LIMIT:
            raise ValueError(f"{path} claims a {length} byte header")
        header = decode(json.loads(f.read(length)))
        size = os.fstat(f.fileno()).st_size
    start = data_offset(length)
    if size != start + header["nbytes"]:
        raise ValueError(f"{path} holds {size} bytes, its header says {start + header['nbytes']}")
    return header, start


def listing(run_id: str) -> dict[str, Any]:
    """What this node holds of a run: each snapshot (group, rank, step and the rank's data
    position there), the newest notes, the epoch that claimed it."""
    folder = run_folder(run_id)
    held = []
    for group, rank, step in snapshots(folder):
        try:
            header, _ = read_header(folder / snapshot_name(group, rank, step))
        except (OSError, ValueError):
            continue  # a file gone meanwhile (an older one dropped) or not ours
        held.append({"group": group, "rank": rank, "step": step, "data_state": header.get("data_state"),
                     "bytes": header["nbytes"]})
    notes = sorted(int(m[1]) for p in folder.iterdir() if (m := NOTE.fullmatch(p.name))) if folder.is_dir() else []
    return {"snapshots": held, "notes": {s: read_note(run_id, s) for s in notes}, "run": read_note(run_id, None),
            "epoch": read_epoch(run_id)}


def note_name(step: int | None) -> str:
    return RUN_NOTE if step is None else f"note-s{step}.json"


def write_note(run_id: str, step: int | None, note: dict[str, Any]) -> None:
    """Keep the controller's note for snapshot `step` (None: the run's note), whole or not at
    all; only the newest snapshot notes are kept."""
    folder = run_folder(run_id)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = folder / f".{note_name(step)}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(encode(note)))
    tmp.replace(folder / note_name(step))
    for old in sorted(int(m[1]) for p in folder.iterdir() if (m := NOTE.fullmatch(p.name)))[:-NOTES_KEPT]:
        (folder / f"note-s{old}.json").unlink(missing_ok=True)


def read_note(run_id: str, step: int | None) -> dict[str, Any] | None:
    try:
        return decode(json.loads((run_folder(run_id) / note_name(step)).read_text()))
    except (OSError, ValueError):
        return None


def read_claim(run_id: str) -> tuple[int, str]:
    """(epoch, owner) of the controller that claimed this node for the run; (0, "") if none."""
    try:
        epoch, _, owner = (run_folder(run_id) / EPOCH).read_text().strip().partition(" ")
        return int(epoch), owner
    except (OSError, ValueError):
        return 0, ""


def read_epoch(run_id: str) -> int:
    return read_claim(run_id)[0]


def claim(run_id: str, epoch: int, owner: str) -> tuple[int, str]:
    """The fence: controller (`epoch`, `owner`) claims this node for the run unless one that
    orders after it did (a newer epoch, or the same epoch and a greater owner token: two
    standbys that woke at once and counted the same epoch). Returns the claim that holds the
    node now, (`epoch`, `owner`) itself when this one stood. Atomic against other claims."""
    folder = run_folder(run_id)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder / f".{EPOCH}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = read_claim(run_id)
        if held > (epoch, owner):
            return held
        tmp = folder / f".{EPOCH}-{os.getpid()}.tmp"
        tmp.write_text(f"{epoch} {owner}")
        tmp.replace(folder / EPOCH)
        return epoch, owner


def drop_run(run_id: str, base: Path | None = None) -> int:
    """Give a finished run's memory back; returns the bytes freed."""
    folder = run_folder(run_id, base)
    freed = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0
    shutil.rmtree(folder, ignore_errors=True)
    return freed


def free_bytes(path: Path | None = None) -> int:
    """Room left where node memory lives (tmpfs: what it may still take of RAM)."""
    path = path or root()
    while not path.exists():
        path = path.parent
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize
