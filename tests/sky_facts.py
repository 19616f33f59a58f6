"""Run by the SkyPilot venv (.venv-sky): what SkyPilot 0.14.1 itself decides for our recipes,
printed as JSON for the tests. SkyPilot lives in its own venv because its click pin
conflicts with wandb's and huggingface-hub's.

    sky_facts.py RECIPE...                    each recipe as SkyPilot loads it, per candidate
    sky_facts.py --replacement RECIPE INFO    the task monarch-sky launches for a lost node
    sky_facts.py --k8s RECIPE LABEL           the recipe on a fake AMD Kubernetes cluster
    sky_facts.py --slurm-names GRES...        which recipe accelerator names match each GRES type
"""

import json
import os
import sys
from pathlib import Path

import sky
from sky.utils import dag_utils


def candidate_facts(r) -> dict:
    return {
        "cloud": str(r.cloud) if r.cloud is not None else None,
        "accelerators": dict(r.accelerators or {}),
        "cpus": r.cpus,
        "memory": r.memory,
        "disk_size_specified": r.disk_size_specified,
        "image": next(iter((r.image_id or {}).values()), None),  # keyed by region once one is set
        "use_spot": r.use_spot,
        "job_recovery": r.job_recovery,
        "region": r.region,
    }


def task_facts(task) -> dict:
    return {
        "name": task.name,
        "num_nodes": task.num_nodes,
        "candidates": [candidate_facts(r) for r in sorted(task.resources, key=str)],
        "envs": task.envs,
        "secret_refs": [ref.name for ref in task._managed_secret_refs],
        "inline_secrets": sorted(task.secrets),
        "setup": task.setup,
        "run": task.run,
        "storage_mounts": {path: {"name": s.name, "mode": s.mode.value} for path, s in (task.storage_mounts or {}).items()},
    }


def recipe_facts(path: str) -> dict:
    if not dag_utils.is_job_group_yaml(path):
        return {"job_group": False, **task_facts(sky.Task.from_yaml(path))}
    from sky import optimizer
    from sky.jobs import job_group_networking

    dag = dag_utils.load_dag_from_yaml(path)
    return {
        "job_group": True,
        "name": dag.name,
        "primary_tasks": dag.primary_tasks,
        "inter_connection": dag.inter_connection,
        # Raises on pins that contradict inter_connection; True = networking was degraded.
        "networking_degraded": optimizer._validate_inter_connection_pins(dag, quiet=True),
        "addresses": {t.name: job_group_networking._get_job_address(t.name, dag.name) for t in dag.tasks},
        "tasks": [task_facts(t) for t in dag.tasks],
    }


def replacement_facts(recipe_path: str, cluster_info: str) -> dict:
    """The one-node task monarch-sky's SkyPilot host provider would launch for a lost node."""
    from monarch_sky.sky_hosts import load_recipe, replacement_task

    os.environ["SKYPILOT_CLUSTER_INFO"] = cluster_info
    config = replacement_task(load_recipe(recipe_path), cluster="monarch-run-r0", port=26600)
    return task_facts(sky.Task.from_yaml_config(config))


def k8s_facts(recipe_path: str, label: str) -> dict:
    """SkyPilot's own feasibility check and pod variables for each Kubernetes candidate, on two
    fake nodes like an MI300X server: 8 amd.com/gpu, 160 CPUs, 1.9 TB memory and only 400 GiB
    of ephemeral storage, labelled skypilot.co/accelerator=LABEL. No cluster is contacted."""
    from unittest import mock

    from sky import clouds
    from sky.provision.kubernetes import utils as ku
    from sky.utils import resources_utils

    def node(name: str):
        capacity = {"cpu": "160", "memory": "1981633424Ki", "amd.com/gpu": "8", "ephemeral-storage": "400Gi"}
        return ku.V1Node.from_dict({
            "metadata": {"name": name, "labels": {"skypilot.co/accelerator": label}},
            "status": {"capacity": capacity, "allocatable": capacity,
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })

    nodes = [node("n0"), node("n1")]
    patches = [
        mock.patch.object(ku, "get_kubernetes_nodes", lambda *a, **k: nodes),
        mock.patch.object(ku, "get_gpu_resource_key", lambda *a, **k: "amd.com/gpu"),
        mock.patch.object(ku, "get_current_kube_config_context_name", lambda: "amd-ctx"),
        mock.patch.object(clouds.Kubernetes, "existing_allowed_contexts",
                          classmethod(lambda cls, silent=False: ["amd-ctx"])),
    ]
    for p in patches:
        p.start()
    k8s, out = clouds.Kubernetes(), []
    for r in sorted(sky.Task.from_yaml(recipe_path).resources, key=str):
        if not isinstance(r.cloud, clouds.Kubernetes):
            continue
        accelerator = next(iter(r.accelerators))
        feasible = k8s._get_feasible_launchable_resources(r).resources_list
        fact = {"accelerator": accelerator, "instance_types": [x.instance_type for x in feasible]}
        if feasible:
            fact["label"] = list(ku.get_accelerator_label_key_values("amd-ctx", accelerator, 8)[:2])
            launchable = feasible[0].copy(region="amd-ctx")
            v = k8s.make_deploy_resources_variables(
                launchable, resources_utils.ClusterName("c", "c-abcd"), clouds.Region("amd-ctx"), None, 2, dryrun=True)
            fact["pod"] = {k: v.get(k) for k in ("cpus", "memory", "accelerator_count", "k8s_resource_key",
                                                 "k8s_ephemeral_storage", "image_id")}
        out.append(fact)
    return {"candidates": out}


def slurm_name_facts(gres_types: list[str]) -> dict:
    from sky.provision.slurm import utils as su

    names = ["MI300X", "MI300", "MI325X", "MI355X"]
    return {g: [n for n in names if su._accelerator_name_matches_slurm(n, g)] for g in gres_types}


def main(args: list[str]) -> None:
    if args[:1] == ["--replacement"]:
        out = replacement_facts(args[1], args[2])
    elif args[:1] == ["--k8s"]:
        out = k8s_facts(args[1], args[2])
    elif args[:1] == ["--slurm-names"]:
        out = slurm_name_facts(args[1:])
    else:
        out = {Path(p).name: recipe_facts(p) for p in args}
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
