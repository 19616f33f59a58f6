"""Where the last-resort checkpoints live, and how the newest complete one is found.

    <checkpoint folder>/step-<S>/          TorchTitan's DCP checkpoint of committed step S
                        .metadata          written by DCP last: the checkpoint is complete
                        monarch_sky.json   the controller's note: what the checkpoint lacks
    <checkpoint folder>/faults-fired.jsonl the scheduled faults the run fired, for a restart
                                           that has the checkpoints but not the run record

The folder is `checkpoint.folder`, by default `<run_dir>/<run_id>/checkpoints` (on the
cloud, `run_dir` on a bucket mounted on every node). The note holds what only the
controller knows: every replica group's data position (each group reads its own shard,
and only one group saves) and the run's shape. A checkpoint counts only with both its
`.metadata` and its note; TorchTitan's purge (`checkpoint.keep`) removes old step folders,
notes included. Nothing here imports torch: the CLI and the controller use it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOTE = "monarch_sky.json"
PROBE = ".seen-by-every-host"  # the controller writes it; each group says whether its hosts see it
STEP_DIR = re.compile(r"step-(\d+)")
UNREADABLE = "cannot load the checkpoint step-{step}"  # a trainer's load error says so (read back by `unreadable`)
FAULTS_FIRED = "faults-fired.jsonl"
SET_ASIDE = "unreadable-{step}"  # no "step-" in it: neither `newest` nor TorchTitan's purge sees it
TARGET_SHARE = 0.01  # a checkpoint interval costs about this share of the throughput


@dataclass(frozen=True)
class CheckpointSpec:
    """What a trainer needs to build its checkpointer (`monarch_sky.replica.trainer_checkpoint`)."""

    folder: str  # absolute
    async_mode: str
    keep: int
    resume_step: int | None = None  # load this step at setup (never when rejoining)
    resume_data: tuple = ()  # per rank of this group: where its data continues
    probe: str | None = None  # a file the controller wrote in `folder`: the trainer says if it sees it


@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    note: dict[str, Any]


def folder_for(cfg) -> Path:
    """The run's checkpoint folder, absolute (trainers on other hosts get the same path): in
    `checkpoint.folder` a folder per run id, so runs sharing a bucket never load, purge or
    discard each other's checkpoints."""
    if cfg.checkpoint.folder:
        folder = os.path.join(cfg.checkpoint.folder, cfg.run_id)
    else:
        folder = os.path.join(cfg.run_dir, cfg.run_id, "checkpoints")
    return Path(os.path.abspath(os.path.expanduser(folder)))


def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """Every `step-N` folder, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def newest(folder: Path, skip: frozenset[int] = frozenset()) -> Found | None:
    """The newest complete checkpoint: DCP finished it (`.metadata`) and its note is there
    (none of the steps in `skip`)."""
    for step, path in reversed(step_dirs(folder)):
        if step in skip or not (path / ".metadata").is_file():
            continue
        try:
            note = decode(json.loads((path / NOTE).read_text()))
        except (OSError, ValueError):
            continue
        if note.get("step") == step:
            return Found(step, path, note)
    return None


def note_fault_fired(folder: Path, spec: str) -> None:
    """Add a scheduled fault's spec to the run's list, on disk before the fault lands (a
    `controller@STEP` fault kills the process that writes this)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / FAULTS_FIRED, "a") as f:
        f.write(json.dumps(spec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def faults_fired(folder: Path) -> list[str]:
    """The specs `note_fault_fired` wrote (a line cut short by a crash is skipped)."""
    try:
        lines = (folder / FAULTS_FIRED).read_text().splitlines()
    except FileNotFoundError:
        return []
    fired = []
    for line in lines:
        try:
            fired.append(str(json.loads(line)))
        except ValueError:
            continue
    return fired


def unreadable(error: str) -> tuple[int, str] | None:
    """If a group failed to start because it could not load a checkpoint: its step, and the
    line that says why (`error`: the whole report, remote traceback included)."""
    m = re.search(UNREADABLE.format(step=r"(\d+)") + r"[^\n]*", error)
    return (int(m.group(1)), m.group(0)[:300]) if m else None


def set_aside(found: Found) -> Path:
    """Move a checkpoint that fails to load out of the way (kept for a look, never loaded again)."""
    target = found.path.with_name(SET_ASIDE.format(step=found.step))
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    found.path.rename(target)
    return target


def discard_newer(folder: Path, step: int) -> list[str]:
    """Remove step folders newer than `step` (an attempt that died mid-write left them).

    The resumed run writes its own steps after `step`; a stale newer folder would sort
    above them and TorchTitan's purge would keep it in place of a complete one.
    """
    removed = []
    for s, path in step_dirs(folder):
        if s > step:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def files(folder: Path) -> list[str]:
    """Every file under the checkpoint folder (checkpoint files and notes, not the probe)."""
    return [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names if f != PROBE]


def write_probe(folder: Path, run_id: str) -> Path:
    """A file in the run's checkpoint folder that every host of every group must see: a folder
    on the controller's own disk (not a shared mount) would keep each save on the node that
    wrote it, where no restarted controller finds it."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / PROBE
    probe.write_text(run_id + "\n")
    return probe


def sees_probe(probe: str | None) -> bool | None:
    """On a trainer's host: whether the controller's probe is visible here (None: no probe)."""
    return None if probe is None else os.path.exists(probe)


def write_note(folder: Path, step: int, note: dict[str, Any]) -> Path:
    """Write a checkpoint's note atomically (a reader sees all of it or none)."""
    path = folder / f"step-{step}"
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{NOTE}.tmp"
    tmp.write_text(json.dumps(encode({**note, "step": step})))
    tmp.replace(path / NOTE)
    return path / NOTE


def encode(value: Any) -> Any:
    """JSON-safe: TorchTitan's dataloader state holds pickled bytes."""
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def interval_min(save_cost_s: float, share: float = TARGET_SHARE) -> float:
    """Minutes between checkpoints so that each one's cost is `share` of the time.

    A save stops training for `save_cost_s` (every group waits for the saving group at the
    next quorum), so one every N minutes costs save_cost_s / (60 N) of the throughput.
    """
    if save_cost_s < 0 or not 0 < share < 1:
        raise ValueError(f"save_cost_s={save_cost_s} must be >= 0 and share={share} in (0, 1)")
    return save_cost_s / (60.0 * share)
