"""A host's Monarch worker loop: the controller attaches here and spawns procs."""

from __future__ import annotations

from monarch_sky import supervision


def run(address: str) -> None:
    supervision.configure_monarch_env()
    from monarch.actor import run_worker_loop_forever

    run_worker_loop_forever(address=address, ca="trust_all_connections")
