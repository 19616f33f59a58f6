"""`SkyPilotHosts`: fixed node addresses, plus replacement nodes launched through SkyPilot.

A replacement is a new one-node cluster launched with the `sky` CLI from the recipe YAML
the cluster came from (worker role only), torn down when the run ends. SkyPilot lives in
its own venv (its click pin conflicts with wandb's), hence the CLI rather than its API.
Every `sky` call is bounded, and a run that shuts down ends a launch in flight.
"""

from __future__ import annotations

import subprocess
import time

from monarch_sky.hosts import AddressListHosts, Host, HostError


class SkyPilotHosts(AddressListHosts):
    """Replacement hosts are launched through the `sky` CLI (SkyPilot lives in its own venv:
    its click pin conflicts with wandb's), from the recipe YAML the cluster came from."""

    def __init__(
        self,
        addresses: list[str],
        controller_ip: str,
        recipe_yaml: str,
        cluster_prefix: str,
        port: int = 26600,
        sky: str = "sky",
        wait_s: float = 1800.0,
    ):
        super().__init__(addresses, controller_ip, wait_s=wait_s)
        self.recipe_yaml = recipe_yaml
        self.cluster_prefix = cluster_prefix
        self.port = port
        self.sky = sky
        self.launched: list[str] = []

    def replace(self, lost: Host) -> Host:
        import tempfile

        import yaml

        cluster = f"{self.cluster_prefix}-r{len(self.launched)}"
        config = replacement_task(load_recipe(self.recipe_yaml), cluster, self.port)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(config, f)
        self.launched.append(cluster)
        self._sky("launch", "-y", "--detach-run", "-c", cluster, f.name)
        ip = self._sky("status", "--ip", cluster).strip().splitlines()[-1]
        host = Host(name=cluster, ip=ip, port=self.port)
        self._wait_up(host)
        return host

    def shutdown(self) -> None:
        """Take down every replacement cluster; raises HostError naming any left up."""
        super().shutdown()
        failed = []
        for cluster in self.launched:
            try:
                self._sky("down", "-y", cluster, timeout_s=600, cancellable=False)
            except HostError as e:
                failed.append(f"{cluster} ({e})")
        if failed:
            raise HostError(f"replacement clusters may still be up, take them down with `sky down`: {'; '.join(failed)}")

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


def load_recipe(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def replacement_task(recipe: dict, cluster: str, port: int) -> dict:
    """A one-node task from a cluster recipe that only serves one replica group's worker."""
    task = {k: v for k, v in recipe.items() if k not in ("secrets", "num_nodes", "name")}
    task["name"] = cluster
    task["num_nodes"] = 1
    task["envs"] = {
        **(recipe.get("envs") or {}),
        "MONARCH_SKY_ROLE": "worker",
        "REPLICAS_PER_NODE": "1",
        "WORKER_PORT": str(port),
    }
    return task
