"""`SkyPilotHosts`: fixed node addresses, plus replacement nodes launched through SkyPilot.

A replacement is a new one-node cluster launched with the `sky` CLI from the recipe YAML
the cluster came from (worker role only), on the same infra and region as this cluster
(SkyPilot's SKYPILOT_CLUSTER_INFO), taken down as soon as no group can use it and at the
run's end. Its address is what
`sky status --ip` prints: on Kubernetes the head pod's internal IP, on Slurm the node's
address; recipes target no other infra. SkyPilot lives in its own venv (its click pin
conflicts with wandb's), hence the CLI rather than its API. Every `sky` call is bounded,
and a run that shuts down ends a launch in flight.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time

from monarch_sky.hosts.addresses import AddressListHosts
from monarch_sky.hosts.base import Host, HostError

log = logging.getLogger(__name__)


DOWN_S = 600.0  # one `sky down`; the clusters go down side by side


class SkyPilotHosts(AddressListHosts):
    """Replacement hosts are launched through the `sky` CLI (SkyPilot lives in its own venv:
    its click pin conflicts with wandb's), from the recipe YAML the cluster came from.

    A cluster goes down as soon as no group can use it: a launch that failed or timed out, a
    replacement that was lost, every one at the run's end (side by side, within `release_s`).
    Each cluster's state is kept in `clusters` and, line by line, in `ledger` (the run record's
    hosts/clusters.jsonl), so one left up is named with the command that takes it down."""

    release_s = DOWN_S + 30.0

    def __init__(
        self,
        addresses: list[str],
        controller_ip: str,
        recipe_yaml: str,
        cluster_prefix: str,
        port: int = 26600,
        sky: str = "sky",
        wait_s: float = 1800.0,
        ledger: str | None = None,
    ):
        super().__init__(addresses, controller_ip, wait_s=wait_s)
        self.cluster_info = this_cluster()
        self.recipe_yaml = recipe_yaml
        self.cluster_prefix = cluster_prefix
        self.port = port
        self.sky = sky
        self.ledger = ledger
        self.clusters: dict[str, str] = {}  # name -> launching, up, going down, down, left up
        self._downs: dict[str, threading.Thread] = {}
        self._left_by_a_controller_before()

    def _left_by_a_controller_before(self) -> None:
        """A controller of this run that came back (same node, same run record) finds in the
        ledger the clusters its predecessor launched: none is any group's now, so each not yet
        down goes down, and new names go on after theirs (a reused name would be relaunched
        onto whatever is left of the old cluster)."""
        states: dict[str, str] = {}
        try:
            with open(self.ledger or "") as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                        states[entry["cluster"]] = entry["state"]
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by the lost controller
        except OSError:
            return
        self.clusters.update(states)
        for name, state in states.items():
            if state != "down":
                log.warning("replacement cluster %s of an earlier controller of this run is %s: taking it down",
                            name, state)
                self._take_down(name)

    def provision(self, lost: Host) -> Host:
        with self.lock:  # two groups lost in one tick get two clusters
            cluster = f"{self.cluster_prefix}-r{len(self.clusters)}"
            self._note(cluster, "launching")
        try:
            host = self._launch(cluster)
        except BaseException:
            self._take_down(cluster)  # whatever SkyPilot brought up of it is of no use now
            raise
        with self.lock:
            self._note(cluster, "up")
        return host

    def _launch(self, cluster: str) -> Host:
        import tempfile

        import yaml

        config = replacement_task(load_recipe(self.recipe_yaml), cluster, self.port, self.cluster_info)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(config, f)
        # The run's CA and the hub token travel from this node's environment, never through the YAML file.
        secrets = [arg for name in FORWARDED_SECRETS if os.environ.get(name) for arg in ("--secret", name)]
        try:
            self._sky("launch", "-y", "--detach-run", "-c", cluster, *secrets, f.name)
        finally:
            os.unlink(f.name)
        ip = self._sky("status", "--ip", cluster).strip().splitlines()[-1]
        host = Host(name=cluster, ip=ip, port=self.port)
        self._wait_up(host)
        return host

    def retire(self, host: Host) -> None:
        if host.name in self.clusters:  # a lost replacement: no group comes back to it
            self._take_down(host.name)

    def give_back(self, host: Host) -> None:
        """A replacement no group took (its group was given up, a refill came too late): it
        goes down now rather than wait, billed, for a fault that may never come."""
        if host.name in self.clusters:
            self._take_down(host.name)
        else:
            super().give_back(host)

    def shutdown(self) -> None:
        """Take down every replacement cluster, side by side; raises HostError naming any left up."""
        super().shutdown()
        with self.lock:
            names = [name for name, state in self.clusters.items() if state != "down"]
        threads = [self._take_down(name) for name in names]
        deadline = time.monotonic() + DOWN_S + 10.0
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        left = self.left_up()
        if left:
            raise HostError(f"replacement clusters may still be up: take them down with `{down_command(left)}`")

    def left_up(self) -> list[str]:
        with self.lock:
            return [name for name, state in self.clusters.items() if state != "down"]

    def _take_down(self, cluster: str) -> threading.Thread:
        """`sky down` the cluster in the background (once); the run's shutdown does not cut it short."""
        with self.lock:
            thread = self._downs.get(cluster)
            if thread is None:
                thread = threading.Thread(target=self._down, args=(cluster,), name=f"sky-down-{cluster}", daemon=True)
                self._downs[cluster] = thread
                self._note(cluster, "going down")
                thread.start()
        return thread

    def _down(self, cluster: str) -> None:
        try:
            self._sky("down", "-y", cluster, timeout_s=DOWN_S, cancellable=False)
            state = "down"
        except HostError as e:
            state = "left up"
            log.warning("replacement cluster %s may still be up (%s): take it down with `%s`", cluster, e,
                        down_command([cluster]))
        with self.lock:
            self._note(cluster, state)

    def _note(self, cluster: str, state: str) -> None:
        """Under `self.lock`: the cluster's new state, also in the ledger."""
        self.clusters[cluster] = state
        if self.ledger:
            with open(self.ledger, "a") as f:
                f.write(json.dumps({"wall": round(time.time(), 3), "cluster": cluster, "state": state}) + "\n")

    def _sky(self, *args: str, timeout_s: float | None = None, cancellable: bool = True) -> str:
        """Run the sky CLI; a run that shuts down ends a cancellable call at once."""
        import tempfile

        command = f"sky {' '.join(args)}"
        limit_s = timeout_s or self.wait_s
        # Files, not pipes: a chatty `sky launch` would block on a full pipe we do not read.
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            try:
                proc = subprocess.Popen([self.sky, *args], stdout=out, stderr=err, text=True)
            except OSError as e:
                raise HostError(f"`{command}` failed: {e}") from None
            deadline = time.monotonic() + limit_s
            while proc.poll() is None:
                if (cancellable and self._closed.is_set()) or time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    why = "the run is shutting down" if self._closed.is_set() else f"it took over {limit_s:.0f}s"
                    raise HostError(f"`{command}` stopped: {why}")
                time.sleep(0.5)
            out.seek(0)
            err.seek(0)
            if proc.returncode != 0:
                raise HostError(f"`{command}` exited {proc.returncode}: {err.read().strip()[-500:]}")
            return out.read()


def down_command(clusters: list[str]) -> str:
    return f"sky down -y {' '.join(clusters)}"


def sky_cli_problem(sky: str, timeout_s: float = 120.0) -> str | None:
    """Why the `sky` CLI on this node cannot launch replacements, or None."""
    try:
        proc = subprocess.run([sky, "api", "info"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{sky} api info` failed: {e}"
    if proc.returncode != 0:
        return f"`{sky} api info` exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
    return None


def load_recipe(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


TLS_SECRETS = ("MONARCH_SKY_TLS_CA", "MONARCH_SKY_TLS_CA_KEY")  # monarch_sky.hosts.tls
FORWARDED_SECRETS = (*TLS_SECRETS, "HF_TOKEN")  # what a replacement node's setup and worker need
CLUSTER_INFO_ENV = "SKYPILOT_CLUSTER_INFO"  # {"cluster_name", "cloud", "region", "zone"}
INFRA_ALIASES = {"k8s": "kubernetes"}


def this_cluster() -> dict:
    """Where the cluster this controller runs in was launched, as SkyPilot tells its tasks."""
    try:
        info = json.loads(os.environ.get(CLUSTER_INFO_ENV) or "{}")
    except json.JSONDecodeError:
        info = {}
    if not info.get("cloud"):
        raise HostError(
            f"{CLUSTER_INFO_ENV} is not set: replacement nodes are launched on this cluster's infra "
            "and region, so the controller must run inside a SkyPilot task"
        )
    return info


def pinned_resources(resources: dict, info: dict) -> dict:
    """The recipe's resources for the infra and region in `info`: the matching `any_of`
    candidate (if any) merged in, and `infra` pinned, so a replacement cannot land elsewhere."""
    cloud = info["cloud"].lower()
    pinned = {k: v for k, v in resources.items() if k != "any_of"}
    for candidate in resources.get("any_of") or []:
        name = str(candidate.get("infra", "")).split("/")[0].lower()
        if INFRA_ALIASES.get(name, name) == cloud:
            pinned.update({k: v for k, v in candidate.items() if k != "infra"})
            break
    pinned["infra"] = "/".join(str(p) for p in (cloud, info.get("region"), info.get("zone")) if p)
    return pinned


def replacement_task(recipe: dict, cluster: str, port: int, info: dict | None = None) -> dict:
    """A one-node task from a cluster recipe that only serves one replica group's worker,
    on the infra and region of this cluster (`info`, default `this_cluster()`)."""
    task = {k: v for k, v in recipe.items() if k not in ("secrets", "num_nodes", "name")}
    task["resources"] = pinned_resources(recipe.get("resources") or {}, info or this_cluster())
    task["name"] = cluster
    task["num_nodes"] = 1
    task["envs"] = {
        **(recipe.get("envs") or {}),
        "MONARCH_SKY_ROLE": "worker",
        "REPLICAS_PER_NODE": "1",
        "WORKER_PORT": str(port),
    }
    return task
