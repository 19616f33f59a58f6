"""A host's Monarch worker loop: the controller attaches here and spawns procs."""

from __future__ import annotations

import os

from monarch_sky.common import platform, supervision
from monarch_sky.hosts.base import parse_address


def run(address: str, until_shutdown: bool = False) -> None:
    """Serve controllers at `address` (tcp://IP:PORT; tls://IP:PORT with monarch_sky.hosts.tls).

    `until_shutdown`: return once a controller shuts this host down at the end of its run
    (node bootstrap); otherwise serve controller after controller until killed.
    """
    # The processes this worker starts inherit its environment: they name their host by
    # the address the controller reaches it on (`platform.advertise_host`).
    advertised = parse_address(address.split("@")[0], name="worker").ip
    if advertised not in ("0.0.0.0", "::", "[::]"):
        os.environ.setdefault(platform.ADVERTISE_ENV, advertised)
    supervision.configure_monarch_env()
    platform.worker_thread_env()
    from monarch.actor import run_worker_loop_forever, run_worker_loop_until_shutdown

    serve = run_worker_loop_until_shutdown if until_shutdown else run_worker_loop_forever
    # Monarch 0.7.0 accepts no other `ca`; a tls:// address uses HYPERACTOR_TLS_* instead.
    serve(address=address, ca="trust_all_connections")
