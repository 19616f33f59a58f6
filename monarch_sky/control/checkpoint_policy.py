"""The last resort, as the controller runs it: when to checkpoint, who saves, how to resume.

Peer healing covers every failure that leaves one replica group alive; a checkpoint is for
the rest (the controller's node lost, every group lost at once). So it stays off the
recovery path:

- Off unless `checkpoint.every_min` > 0 (the local default is 0; the cloud recipes set it).
- One group saves: the lowest-index group that trains, right after a step it committed with
  the others at the run's newest step (DiLoCo: a sync), once `every_min` has passed since
  the last save. The controller asks it between two of its steps; the others wait for it
  at their next quorum, which is the cost (`tools/checkpoint_cost.py` measures it).
- Beside each checkpoint the controller writes what the checkpoint lacks: every group's
  data position at that step (`monarch_sky.common.checkpoints`).
- Read when a controller restarts a run (same `run_id`) that has one: every group loads the
  newest at setup and training goes on from its step. And read by a live controller when
  every group holding the training state failed at once: a new generation that has no one
  to heal from loads the newest instead (`monarch_sky.control.rejoin.checkpoint_to_reload`). A
  group that rejoins while another holds the state heals from a peer, always.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from monarch_sky.common import checkpoints
from monarch_sky.common.checkpoints import CheckpointSpec, Found
from monarch_sky.control.checkpoint_loads import CheckpointLoads
from monarch_sky.control.checkpoint_resume import SHAPE, data_states, fingerprint
from monarch_sky.control.context import off_loop
from monarch_sky.control.slot_state import SlotState


class CheckpointPolicy:
    def __init__(self, ctx, resume: Found | None = None, previous: dict[str, Any] | None = None):
        self.ctx = ctx
        self.previous = previous  # what resume_from said about the restart; kept true by set_aside
        self.settings = ctx.cfg.checkpoint
        self.every_s = self.settings.every_min * 60.0
        self.folder = checkpoints.folder_for(ctx.cfg)
        self.resume = resume
        self.saved: list[dict[str, Any]] = []  # step, replica, blocking_s of each staged save
        self.failed: list[dict[str, Any]] = []
        self._last_at: float | None = None  # when the interval started (training, or the last save)
        self.off_because: str | None = None  # why checkpoints were turned off although asked for
        self.probe: str | None = None
        self.unreadable: set[int] = set()  # the steps of checkpoints that failed to load, set aside
        self.loads = CheckpointLoads(ctx.record)  # which group loads which checkpoint (one loaded is readable)
        if self.every_s > 0:
            try:
                self.probe = str(checkpoints.write_probe(self.folder, ctx.cfg.run_id))
            except OSError as e:
                self._turn_off(f"the controller cannot write {self.folder} ({e.strerror})")

    @property
    def enabled(self) -> bool:
        return self.every_s > 0 and self.off_because is None

    def note_fault_fired(self, spec: str) -> None:
        """Keep a fired scheduled fault beside the checkpoints (the run record may not survive)."""
        if self.every_s > 0:  # turned off later, the folder may still hold the run's checkpoints
            try:
                checkpoints.note_fault_fired(self.folder, spec)
            except OSError as e:
                self.ctx.record.event("fault_note_failed", spec=spec, reason=e.strerror)

    def check_seen(self, index: int, seen: bool | None) -> None:
        """A group's hosts said whether they see the controller's probe in the checkpoint
        folder: a save they wrote elsewhere would be lost with their node, so none is taken."""
        if seen is False and self.enabled:
            self._turn_off(f"replica {index}'s hosts do not see {self.folder}, which is on the controller's "
                           "disk only: set RUN_DIR or checkpoint.folder to a folder every node mounts")

    def _turn_off(self, reason: str) -> None:
        self.off_because = reason
        self.ctx.record.event("checkpoints_off", reason=reason)
        self.ctx.display.line(f"monarch-sky: WARNING: checkpoints off: {reason} (docs/checkpoints.md)")

    def spec_for(self, index: int, resume: Found | None = None) -> CheckpointSpec | None:
        """What replica group `index`'s trainers build; None: no checkpointer at all.
        `resume`: the checkpoint they load at setup (default: the one the run resumed from)."""
        if not self.enabled and self.resume is None:
            return None
        resume = resume or self.resume
        resume_step, data = None, ()
        if resume is not None:
            resume_step = resume.step
            data = data_states(resume, index)
        return CheckpointSpec(str(self.folder), self.settings.async_mode, self.settings.keep, resume_step, data,
                              probe=self.probe)

    async def newest(self) -> Found | None:
        """The run's newest complete checkpoint, for a live controller whose groups all lost
        the training state; None if checkpoints are off or none is complete yet."""
        if not self.enabled and self.resume is None:
            return None
        found = await off_loop(checkpoints.newest, self.folder, frozenset(self.unreadable))
        if found is None or found.note.get("run_id", self.ctx.cfg.run_id) != self.ctx.cfg.run_id:
            return None  # resume_from refused another run's at start; one copied in since is not ours either
        return found

    async def set_aside(self, found: Found, reason: str) -> Found | None:
        """A group could not load `found`: move it out of the way (once, however many groups
        failed on it) and return the next newest complete checkpoint, which the run goes back
        to instead (None: there is none, and training starts over)."""
        first = found.step not in self.unreadable
        self.unreadable.add(found.step)
        older = await self.newest()
        if first:
            try:
                moved = str(await off_loop(checkpoints.set_aside, found))
            except OSError as e:
                moved = f"left in place ({e.strerror})"
            self.ctx.record.event("checkpoint_unreadable", step=found.step, path=str(found.path), moved_to=moved,
                                  reason=reason, going_back_to=older.step if older else None)
            instead = f"the checkpoint at step {older.step}" if older else "no older checkpoint: training starts over"
            self.ctx.display.line(f"[checkpoint] WARNING: the checkpoint at step {found.step} cannot be loaded "
                                  f"({reason}); set aside as {moved}; going back to {instead}")
        if self._last_at is None and self.resume is not None and self.resume.step == found.step:  # a restart's
            self.resume = older
            if self.previous is not None:
                self.previous["resumed_from_step"] = older.step if older else None
                self.previous["steps_lost"] = self.previous["last_step"] - (older.step if older else 0)
        return older

    def drop_resume(self) -> None:
        """The run goes on from newer state in node memory: load no checkpoint at start."""
        if self.resume is not None and self.previous is not None:
            self.previous["resumed_from_step"] = None
        self.resume = None

    def none_to_reload(self) -> str:
        """Why a run that lost its training state starts over instead of loading a checkpoint."""
        if self.enabled or self.resume is not None:
            return "no checkpoint was complete yet"
        return f"checkpoints are off ({self.off_because})" if self.off_because else "checkpoints are off (checkpoint.every_min=0)"

    def start_training(self) -> None:
        """The groups are up (a resumed run's loaded the checkpoint): start the clock."""
        ctx = self.ctx
        self._last_at = time.monotonic()
        if self.resume is not None:
            step = self.resume.step
            ctx.ledger.run_step = ctx.ledger.logged_step = step
            for slot in ctx.slots:  # a group that fails before its first step goes on from here
                slot.step = step
                slot.data_states = data_states(self.resume, slot.index)
            past = [f for f in ctx.injector.pending if not f.during and f.step <= step]  # the lost attempt's to inject
            for fault in past:
                ctx.injector.pending.remove(fault)
            ctx.record.event("resumed_from_checkpoint", step=step, path=str(self.resume.path),
                             faults_skipped=[str(f) for f in past])
            ctx.phase(f"resumed from the checkpoint at step {step} ({self.resume.path})")
        if self.enabled:
            ctx.record.event("checkpoints_on", every_min=self.settings.every_min, folder=str(self.folder))
            ctx.phase(
                f"a checkpoint every {self.settings.every_min:g} min to {self.folder} "
                "(the last resort: healing never reads it; every node must see this folder)"
            )

    async def after_step(self, slot, r) -> None:
        """Called by a slot after each step result; saves when this slot is due to."""
        if r.write_failed:
            self._write_failed(slot, *r.write_failed)
        if self._due(slot, r):
            await self._save(slot, r.step)

    def _due(self, slot, r) -> bool:
        ctx = self.ctx
        if not self.enabled or ctx.finishing or self._last_at is None or not r.synced:
            return False
        if time.monotonic() - self._last_at < self.every_s or r.step < ctx.ledger.run_step:
            return False
        if r.step <= max((s["step"] for s in self.saved), default=self.resume.step if self.resume else 0):
            return False
        saver = next((s for s in ctx.slots if s.state is SlotState.TRAINING), None)
        return saver is slot

    async def _save(self, slot, step: int) -> None:
        """Ask `slot`'s group to save; a failed save is recorded, and training goes on.
        The group dying meanwhile raises GroupFailed to the slot, as a step would."""
        ctx = self.ctx
        self._last_at = began = time.monotonic()
        info = await slot.group.save_checkpoint(step, ctx.cfg.timeouts.step_s)
        waited_s = round(time.monotonic() - began, 3)
        if info["error"]:
            self.failed.append({"step": step, "replica": slot.index, "error": info["error"], "stage": "save"})
            ctx.record.event("checkpoint_failed", replica=slot.index, step=step, error=info["error"], stage="save")
            ctx.display.line(f"[checkpoint] replica {slot.index} could not save step {step}: {info['error']}")
            return
        saved = {"step": step, "replica": slot.index, "blocking_s": round(info["blocking_s"], 4), "waited_s": waited_s}
        self.saved.append(saved)
        ctx.record.event("checkpoint_staged", **saved)
        ctx.in_background(self._write_note(step, slot.index))

    def _write_failed(self, slot, step: int, error: str) -> None:
        """The background write of `step` failed (reported by the step after it finished):
        the checkpoint never completes, and the one before it stays the one to go back to."""
        if any(f["step"] == step for f in self.failed):
            return  # another rank of the group said so already
        self.failed.append({"step": step, "replica": slot.index, "error": error, "stage": "write"})
        self.saved = [s for s in self.saved if s["step"] != step]
        self.ctx.record.event("checkpoint_failed", replica=slot.index, step=step, error=error, stage="write")
        self.ctx.display.line(f"[checkpoint] WARNING: replica {slot.index}'s write of step {step} failed: {error}; "
                              "the checkpoint before it stays the newest")

    async def _write_note(self, step: int, saver: int) -> None:
        """Note every group's data position at `step` once each training group reached it."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.cfg.timeouts.step_s
        while time.monotonic() < deadline and not ctx.finishing:
            if all(s.step >= step for s in ctx.slots if s.state is SlotState.TRAINING):
                break
            await asyncio.sleep(0.05)
        data = {}
        for slot in ctx.slots:
            states = ctx.data_history.at(slot.index, step)
            data[str(slot.index)] = list(states if states is not None else slot.data_states)
        cfg = ctx.cfg
        settings = fingerprint(cfg)
        note = {
            "run_id": cfg.run_id, "saved_by": saver, "wall": round(time.time(), 3),
            **{k: settings.pop(k) for k in SHAPE}, "settings": settings, "data_states": data,
        }
        path = await asyncio.wait_for(off_loop(checkpoints.write_note, self.folder, step, note), cfg.timeouts.stop_s)
        ctx.record.event("checkpoint_noted", step=step, path=str(path))

    def summary(self) -> dict[str, Any]:
        blocking = [s["blocking_s"] for s in self.saved]
        return {
            "every_min": self.settings.every_min,
            "folder": str(self.folder) if self.enabled or self.resume else None,
            "saved_steps": [s["step"] for s in self.saved],
            "failed": self.failed,
            "median_blocking_s": round(statistics.median(blocking), 4) if blocking else None,
            "resumed_from_step": self.resume.step if self.resume else None,
            "off_because": self.off_because,
        }
