"""Which group loads which checkpoint: one a group loaded is readable, whatever another's failure.

A group that fails to load a checkpoint does not make it unreadable on its own say: a
transient error (a slow bucket, a host's flaky mount) fails one group while another loads the
same files. Setting the checkpoint aside then would send the run back further than it went
(the group that loaded it trains on from the newer step) and hide a good checkpoint. So a
failed load waits for the other groups still loading the same checkpoint: if one loaded it,
the failure is the group's own (it retries, spending a restart); only when none did is the
checkpoint unreadable and set aside.
"""

from __future__ import annotations

import asyncio
import enum
import time

POLL_S = 0.05


class LoadFailure(enum.Enum):
    UNREADABLE = "unreadable"  # no group could load it: set it aside, go back to an older one
    LOADED_ELSEWHERE = "loaded elsewhere"  # another group loaded it: this group's own failure
    NOT_THE_CHECKPOINT = "not the checkpoint"  # the build failed for another reason


class CheckpointLoads:
    def __init__(self, record) -> None:
        self.record = record
        self._loading: dict[int, set[int]] = {}  # checkpoint step -> groups loading it now
        self._loaded: dict[int, set[int]] = {}  # checkpoint step -> groups that loaded it

    def begin(self, found, index: int) -> None:
        """Group `index` builds a generation that loads `found` (None: loads nothing)."""
        if found is not None:
            self._loading.setdefault(found.step, set()).add(index)

    def loaded(self, found, index: int) -> None:
        if found is not None:
            self._loading[found.step].discard(index)
            self._loaded.setdefault(found.step, set()).add(index)

    def abandon(self, found, index: int) -> None:
        """The build loading `found` was cancelled (the run ends)."""
        if found is not None:
            self._loading[found.step].discard(index)

    def holders(self, step: int) -> set[int]:
        """The groups whose live generation loaded the checkpoint of `step`."""
        return set(self._loaded.get(step, ()))

    def forget(self, index: int) -> None:
        """Group `index`'s generation ended: whatever it loaded, it holds no more."""
        for groups in self._loaded.values():
            groups.discard(index)

    async def failed(self, found, index: int, unreadable: tuple[int, str] | None,
                     timeout_s: float) -> LoadFailure | None:
        """Group `index`'s build that was loading `found` failed (`unreadable`: the step and the
        reason if a checkpoint load failed it, `checkpoints.unreadable`): what that says about
        the checkpoint, once every other group loading it finished (or `timeout_s` passed:
        then what is known). None if it was loading none."""
        if found is None:
            return None
        step = found.step
        self._loading[step].discard(index)
        if unreadable is None or unreadable[0] != step:
            return LoadFailure.NOT_THE_CHECKPOINT
        deadline = time.monotonic() + timeout_s
        while self._loading.get(step, set()) - {index} and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        loaded_by = sorted(self.holders(step) - {index})
        if not loaded_by:
            return LoadFailure.UNREADABLE
        self.record.event("checkpoint_load_failed_here", replica=index, step=step, loaded_by=loaded_by,
                          reason=unreadable[1])
        return LoadFailure.LOADED_ELSEWHERE
