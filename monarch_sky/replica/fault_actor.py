"""The actor that carries a process fault out inside a trainer process (the spec is
`monarch_sky/faults/spec.py`; the injector decides when)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading

from monarch.actor import Actor, endpoint


class FaultActor(Actor):
    """Lives beside each trainer process and injects faults into it on request.

    It is a separate actor so it can act while the trainer is busy in a step.
    """

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def inject(self, kind: str, delay_s: float = 0.0) -> None:
        # Fire from a timer so this call returns before the process dies.
        threading.Timer(max(delay_s, 0.01), _FAULTS[kind]).start()


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _segfault() -> None:
    ctypes.string_at(0)


def _comms() -> None:
    """Abort the trainer's TorchFT process group: its cross-group collectives fail."""
    from monarch_sky.replica import trainer

    if trainer.ACTIVE is not None:
        trainer.ACTIVE.manager._pg.abort()  # torchft's ManagedProcessGroup has no public abort


def _hang() -> None:
    # A foreign call through PyDLL keeps the GIL: every Python thread of the process stops,
    # while TorchFT's native heartbeat threads and the sockets stay alive.
    ctypes.PyDLL(None).sleep(24 * 3600)


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


_FAULTS = {"kill": _kill, "segfault": _segfault, "comms": _comms, "hang": _hang, "stop": _stop}
