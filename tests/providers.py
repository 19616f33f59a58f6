"""Host providers that misbehave on purpose, run under a real controller.

`python tests/providers.py KIND KEY=VALUE ...` runs `monarch-sky train` with the provider
KIND instead of the one the config names; everything else is the real thing.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from monarch_sky.hosts.base import Host
from monarch_sky.hosts.local import LocalHosts


class FailsOnceHosts(LocalHosts):
    """The first replacement request fails the way a cloud API error would."""

    failed = False

    def replace(self, lost: Host) -> Host:
        if not self.failed:
            self.failed = True
            raise RuntimeError("provider API error 500 (test)")
        return super().replace(lost)


class NeverAnswersHosts(LocalHosts):
    """A replacement request that never returns and cannot be interrupted (a stuck `sky launch`)."""

    def replace(self, lost: Host) -> Host:
        time.sleep(3600)
        raise AssertionError("unreachable")


class DiesOnArrivalHosts(LocalHosts):
    """The first replacement host dies a few seconds after it is handed out: while the
    group's new generation is being built on it."""

    DIES_AFTER_S = 6.0
    handed_out = 0

    def provision(self, lost: Host) -> Host:
        host = super().provision(lost)
        self.handed_out += 1
        if self.handed_out == 1:
            threading.Timer(self.DIES_AFTER_S, self.kill, [host]).start()
        return host


class WatchesEvents(LocalHosts):
    """A provider that acts on what the run records (its events.jsonl)."""

    events: Path | None = None  # the run's events.jsonl, set by main

    def wait_for_event(self, match, every_s: float) -> dict | None:
        """The first event `match` accepts, polled every `every_s`; None once the provider closes."""
        while not self._closed.wait(every_s):
            if not self.events.exists():
                continue
            for line in self.events.read_text().splitlines():
                try:
                    event = json.loads(line)
                except ValueError:  # a line still being written
                    continue
                if match(event):
                    return event
        return None


class SpareDiesIdleHosts(WatchesEvents):
    """The first spare host (`hosts.spares`) dies two seconds after the run records it ready
    (its `spare_ready` event), before any group needs it."""

    def spare_hosts(self, count: int) -> list[Host]:
        hosts = super().spare_hosts(count)
        if hosts:
            threading.Thread(target=self._kill_once_ready, args=(hosts[0],), daemon=True).start()
        return hosts

    def _kill_once_ready(self, host: Host) -> None:
        if self.wait_for_event(lambda e: e["event"] == "spare_ready" and e["host"] == host.address, 0.5):
            time.sleep(2.0)
            self.kill(host)


class SpareDiesOnPromotionHosts(WatchesEvents):
    """The first spare a group takes dies as soon as the run records the group on it (its
    `host_replaced` event), while the group's new generation builds there."""

    def spare_hosts(self, count: int) -> list[Host]:
        hosts = super().spare_hosts(count)
        threading.Thread(target=self._kill_the_first_promoted, args=(hosts,), daemon=True).start()
        return hosts

    def _kill_the_first_promoted(self, spares: list[Host]) -> None:
        event = self.wait_for_event(lambda e: e["event"] == "host_replaced" and e["spare"], 0.1)
        if event:
            self.kill(next(h for h in spares if h.address == event["host"]))


class BrokenHosts(LocalHosts):
    """A provider with a bug: the controller's own start-up raises something no code expects."""

    def controller_ip(self) -> str:
        raise RuntimeError("controller_ip broke (test)")


class PrivateDiskHosts(LocalHosts):
    """Hosts with a disk of their own, as cloud nodes have: each worker runs in its own mount
    namespace with an empty tmpfs over the run's record folder, so the controller's files there
    (the checkpoint folder among them) are not visible to it. Needs root."""

    record: Path | None = None  # the run's record folder, set by main

    def worker_command(self, host: Host) -> list[str]:
        hide = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide, str(self.record),
                *super().worker_command(host)]


PROVIDERS = {"broken": BrokenHosts, "private-disk": PrivateDiskHosts, "fails-once": FailsOnceHosts, "never-answers": NeverAnswersHosts, "dies-on-arrival": DiesOnArrivalHosts,
             "spare-dies-idle": SpareDiesIdleHosts, "spare-dies-on-promotion": SpareDiesOnPromotionHosts}


def main(kind: str, overrides: list[str]) -> int:
    from monarch_sky.common import supervision

    supervision.configure_monarch_env()
    from monarch_sky.config import load_job
    from monarch_sky.run import run_job

    job = load_job(overrides)
    cfg = job.config
    provider = PROVIDERS[kind](cfg.run_id, provision_delay_s=cfg.hosts.provision_delay_s)
    provider.record = Path(cfg.run_dir).resolve() / cfg.run_id
    provider.events = provider.record / "events.jsonl"
    return run_job(job, provider)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
