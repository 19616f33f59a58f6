"""The host provider a job's `hosts.*` settings ask for: the one module that knows them all."""

from __future__ import annotations

import os

from monarch_sky.hosts.addresses import AddressListHosts
from monarch_sky.hosts.base import HostProvider, parse_address
from monarch_sky.hosts.local import LocalHosts


def make_provider(settings, run_id: str, log_dir: str) -> HostProvider:
    """The host provider a job's `hosts.*` settings ask for."""
    if settings.provider == "skypilot":
        from monarch_sky.hosts.sky import SkyPilotHosts  # only a skypilot run pays its imports

        return SkyPilotHosts(
            list(settings.addresses),
            settings.controller_ip,
            recipe_yaml=settings.recipe_yaml,
            cluster_prefix=settings.cluster_prefix or f"monarch-{run_id}"[:40],
            port=parse_address(settings.addresses[0], name="first").port,
            sky=settings.sky_cli,
            wait_s=settings.provision_timeout_s,
            ledger=os.path.join(log_dir, "clusters.jsonl"),
        )
    if settings.provider == "addresses":
        return AddressListHosts(
            list(settings.addresses), settings.controller_ip, wait_s=settings.provision_timeout_s
        )
    return LocalHosts(
        run_id,
        log_dir=log_dir,
        provision_delay_s=settings.provision_delay_s,
        max_replacements=settings.max_replacements,
    )
