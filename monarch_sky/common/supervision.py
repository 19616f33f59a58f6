"""Monarch supervision for the controller: fast failure detection that never exits.

Monarch reports a dead process as a `MeshFailure` for each actor mesh on it. Failures no
actor handles reach `monarch.actor.unhandled_fault_hook`, whose default exits the
controller. `FailureRouter` replaces it: it maps the failed actor mesh to the replica group
that owns it (actor meshes are named `<owner>-<role>`) and hands the failure to the
controller. Failures of Monarch's internal meshes (the log forwarder) are ignored: the
group's own meshes fail too.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)

# Monarch polls process state; its defaults notice a dead process after ~10 s and a dead
# host after ~70 s. These must be in the environment before Monarch starts; a value
# already in the environment wins.
MONARCH_ENV = {
    "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": "1s",
    "HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE": "5s",
}


def configure_monarch_env() -> None:
    for key, value in MONARCH_ENV.items():
        os.environ.setdefault(key, value)


def mesh_owner(mesh_name: str) -> str:
    """`r1g0-replica-Xy7...` -> `r1g0`: the owner part of a mesh name we gave."""
    return mesh_name.split("-", 1)[0]


class FailureRouter:
    """Installs itself as Monarch's unhandled fault hook; call `uninstall()` when the run ends."""

    def __init__(self, on_failure: Callable[[str, str], None]):
        self._on_failure = on_failure  # (owner, report) -> None; called on a Monarch thread
        self._owners: set[str] = set()
        self._lock = threading.Lock()
        import monarch.actor

        monarch.actor.unhandled_fault_hook = self._hook

    def watch(self, owner: str) -> None:
        with self._lock:
            self._owners.add(owner)

    def unwatch(self, owner: str) -> None:
        with self._lock:
            self._owners.discard(owner)

    def _hook(self, failure) -> None:
        try:
            owner = mesh_owner(failure.mesh_name)
            with self._lock:
                watched = owner in self._owners
            if watched:
                self._on_failure(owner, failure.report())
            else:
                log.debug("ignoring failure of mesh %s", failure.mesh_name)
        except Exception:  # a raising hook would make Monarch exit the controller
            log.exception("fault hook failed")

    def uninstall(self) -> None:
        """Stop routing. A failure that still comes (a mesh of the ended run timing out while it
        stops) is logged, never handed back to Monarch's default hook: that would exit a
        controller whose run already ended (seen once: a killed generation's proc agent timed out
        during the final reap, and a run that had reached its target exited -2)."""
        import monarch.actor

        monarch.actor.unhandled_fault_hook = _after_the_run


def _after_the_run(failure) -> None:
    log.info("ignoring a failure after the run ended: mesh %s", getattr(failure, "mesh_name", "?"))


def short_reason(report: str) -> str:
    """One line a user can act on, from a Monarch supervision report or an error."""
    text = str(report)
    marker = "the process this actor was running on failed:"
    if marker in text:
        return "process died: " + text.rsplit(marker, 1)[1].strip().splitlines()[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "unknown failure"
    if any(line.startswith("Traceback") for line in lines):
        return lines[-1][:300]  # the exception itself
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {lines[1]}"
    if "> has status:" in first:  # "... actor <root>.<...> has status: <status>"
        return "actor " + first.rsplit("> has status:", 1)[1].strip()[:280]
    return first[:300]


async def resolved(future):
    """Await a Monarch future (a call or a mesh's readiness) as a coroutine, so asyncio can
    time it out."""
    return await future


def describe_error(e: BaseException) -> str:
    """One line for a failure of any kind: a timeout, a Monarch report, an exception."""
    import asyncio

    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return short_reason(str(e)) if str(e) else type(e).__name__
