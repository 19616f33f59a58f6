"""The actor that carries a process fault out inside a trainer process (the spec is
`monarch_sky/faults/spec.py`; the injector decides when)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading

from monarch.actor import Actor, endpoint

SERVE_WAIT_S = 60.0  # a `@serve` fault whose group serves no heal by then fires all the same


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

    @endpoint
    def inject_when_serving(self, kind: str) -> None:
        """Fire `kind` as this process begins to send a rejoining peer its state (the `tcp`
        heal's first range), or after SERVE_WAIT_S if it serves nothing by then."""
        from monarch_sky.replica import trainer

        fire = _once(_FAULTS[kind])
        transport = trainer.ACTIVE.transport if trainer.ACTIVE is not None else None
        server = getattr(transport, "server", None)
        if server is not None:
            server.before_range = fire
        timer = threading.Timer(SERVE_WAIT_S, fire)
        timer.daemon = True
        timer.start()


def _once(fault):
    lock = threading.Lock()
    fired = []

    def fire() -> None:
        with lock:
            if fired:
                return
            fired.append(True)
        fault()
    return fire


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
