"""A host's Monarch worker loop: the controller attaches here and spawns procs."""

from __future__ import annotations

from monarch_sky import platform, supervision


def run(address: str, until_shutdown: bool = False) -> None:
    """Serve controllers at `address` (tcp://IP:PORT; tls://IP:PORT with monarch_sky.tls).

    `until_shutdown`: return once a controller shuts this host down at the end of its run
    (node bootstrap); otherwise serve controller after controller until killed.
    """
    supervision.configure_monarch_env()
    platform.worker_thread_env()
    from monarch.actor import run_worker_loop_forever, run_worker_loop_until_shutdown

    serve = run_worker_loop_until_shutdown if until_shutdown else run_worker_loop_forever
    # Monarch 0.7.0 accepts no other `ca`; a tls:// address uses HYPERACTOR_TLS_* instead.
    serve(address=address, ca="trust_all_connections")
