"""Where a rank is in its data shard, kept in step with what it actually trained on.

A step draws batches from the rank's shard, but only a step whose update stands keeps
them: a step TorchFT did not commit, a healing step (a healing rank's gradient is zeroed)
and the inner steps a failed DiLoCo sync rolls back trained on nothing. So each rank keeps
the dataloader's state at the last point whose training stands, rewinds to it when the
batches since were not kept, and reports it with every step. The controller hands it to
the group's next generation, which continues exactly there: after a fault no batch is
trained twice and none is skipped. The state is torchtitan's dataloader state (a few
integers and a token buffer); nothing is written to disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from monarch_sky.common import test_hooks


@dataclass(frozen=True)
class DataHandover:
    """Where a group's next generation starts reading.

    `states`: per rank, the dataloader state at the last point whose training stands, as
    the group's last step result reported it. `skip_steps`: steps of batches trained after
    that report, by a commit the controller never heard of (a rank died after its group's
    commit; `rejoin.trained_unreported`).
    """

    states: tuple = ()
    skip_steps: int = 0


class DataPosition:
    def __init__(self, dataloader, batches: Callable[[Any], Iterator], start: dict | None, name: str):
        if start:
            dataloader.load_state_dict(start)
        self._loader = dataloader
        self._make_batches = batches
        self._batches = batches(dataloader)
        self.kept: dict = dataloader.state_dict()
        self._pending: list[str] = []  # hashes of batches drawn since the kept position
        log_dir = test_hooks.batch_log_dir()
        self._log = os.path.join(log_dir, f"{name}.jsonl") if log_dir else None

    def draw(self, count: int) -> list:
        batches = [next(self._batches) for _ in range(count)]
        if self._log:
            self._pending += [_hash(labels) for _, labels in batches]
        return batches

    def skip(self, count: int) -> None:
        """Pass over `count` batches that an earlier generation trained on but never reported."""
        for _ in range(count):
            next(self._batches)
        if count:
            self.kept = self._loader.state_dict()

    def keep(self) -> None:
        """The batches drawn since the kept position were trained on, for good."""
        self.kept = self._loader.state_dict()
        self._record(kept=True)

    def rewind(self) -> None:
        """They trained nothing: read them again."""
        self._loader.load_state_dict(self.kept)
        self._batches = self._make_batches(self._loader)
        self._record(kept=False)

    def _record(self, kept: bool) -> None:
        if self._log and self._pending:
            with open(self._log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "kept": kept, "batches": self._pending}) + "\n")
        self._pending = []


def _hash(labels) -> str:
    return hashlib.sha256(labels.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
