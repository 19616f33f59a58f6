"""Run by the SkyPilot venv (.venv-sky): what SkyPilot 0.14.1 itself decides for our recipes,
printed as JSON for the tests. SkyPilot lives in its own venv because its click pin
conflicts with wandb's and huggingface-hub's.

    sky_facts.py RECIPE...                    each recipe as SkyPilot loads it, per candidate
    sky_facts.py --replacement RECIPE INFO    the task monarch-sky launches for a lost node
    sky_facts.py --k8s RECIPE LABEL           the recipe on a fake AMD Kubernetes cluster
    sky_facts.py --slurm-names GRES...        which recipe accelerator names match each GRES type
    sky_facts.py --launch WORDS...            what `sky WORDS` (launch, jobs launch, exec) builds before any cloud call
    sky_facts.py --pod RECIPE                 the container spec SkyPilot merges the recipe's kubernetes.pod_config into
    sky_facts.py --driver RECIPE              the Ray driver program SkyPilot runs on the head for the recipe's `run`
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
        "inline_secrets": sorted(k for k, v in task.secrets.items() if v.get_secret_value()),  # with a value
        "optional_secrets": sorted(k for k, v in task.secrets.items() if not v.get_secret_value()),  # "" by default
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
    from monarch_sky.hosts.sky import load_recipe, replacement_task

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


def launch_facts(words: list[str]) -> dict:
    """`sky launch ...` or `sky jobs launch ...` up to its first contact with a server: SkyPilot's
    own CLI parses the flags (a `--secret NAME` not in the environment fails there), builds the
    task or job group with the overrides, and resolves its secrets as `sky.execution` does (a
    declared secret left without a value is refused)."""
    import click
    from sky import dag as dag_lib
    from sky import execution
    from sky.client.cli import command

    commands = {("launch",): command.launch, ("jobs", "launch"): command.jobs_launch, ("exec",): command.exec}
    size = 2 if words[:1] == ["jobs"] else 1
    cmd = commands[tuple(words[:size])]
    try:
        params = cmd.make_context(" ".join(words[:size]), words[size:]).params
        envs = command._merge_cli_and_file_vars([params.get("env_file")], params["env"])
        secrets = command._merge_cli_and_file_vars([params.get("env_file"), params.get("secret_file")], params["secret"])
        built = command._make_task_or_dag_from_entrypoint_with_overrides(
            params["entrypoint"], num_nodes=params["num_nodes"], env=envs, secret=secrets)
        dag = built if isinstance(built, dag_lib.Dag) else dag_utils.convert_entrypoint_to_dag(built)
        execution._resolve_managed_secrets(dag)
    except (click.UsageError, RuntimeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e.format_message() if isinstance(e, click.UsageError) else e}"}
    return {"error": None, "tasks": {t.name: {"num_nodes": t.num_nodes, "secrets": sorted(t.secrets),
                                              "role": t.envs.get("MONARCH_SKY_ROLE"),
                                              "empty_secrets": sorted(k for k, v in t.secrets.items() if not v.get_secret_value())}
                                     for t in dag.tasks}}


def driver_facts(recipe_path: str) -> dict:
    """The program SkyPilot's job driver runs for the recipe on a Ray-based infra (Kubernetes),
    as `CloudVmRayBackend._execute_task_n_nodes` builds it: one Ray task per node."""
    from sky.backends import task_codegen

    task = sky.Task.from_yaml(recipe_path)
    nodes, resources = task.num_nodes, {"CPU": 1.0, "MI300X": 8.0}
    codegen = task_codegen.RayCodeGen()
    codegen.add_prologue(job_id=1)
    codegen.add_setup(nodes, dict(resources), stable_cluster_internal_ips=[f"10.0.0.{i + 1}" for i in range(nodes)],
                      env_vars={}, log_dir="~/sky_logs/x", setup_cmd=None)
    codegen.add_task(nodes, bash_script=task.run, task_name=task.name, resources_dict=dict(resources),
                     log_dir="~/sky_logs/x", env_vars={})
    codegen.add_epilogue()
    return {"code": codegen.build()}


def pod_facts(recipe_path: str) -> dict:
    """Each Kubernetes candidate's container after SkyPilot folds the task's `config:`
    (kubernetes.pod_config) into its pod, as provisioning does (combine_pod_config_fields)."""
    from sky import clouds
    from sky.provision.kubernetes import utils as ku

    out = []
    for r in sorted(sky.Task.from_yaml(recipe_path).resources, key=str):
        if not isinstance(r.cloud, clouds.Kubernetes):
            continue
        pod = {"available_node_types": {"ray_head_default": {"node_config": {
            "spec": {"containers": [{"name": "ray", "resources": {"limits": {"amd.com/gpu": 8}}}]}}}}}
        merged = ku.combine_pod_config_fields(pod, r.cluster_config_overrides or {}, cloud=r.cloud)
        out.append(merged["available_node_types"]["ray_head_default"]["node_config"]["spec"]["containers"])
    return {"containers": out}


def main(args: list[str]) -> None:
    if args[:1] == ["--replacement"]:
        out = replacement_facts(args[1], args[2])
    elif args[:1] == ["--k8s"]:
        out = k8s_facts(args[1], args[2])
    elif args[:1] == ["--pod"]:
        out = pod_facts(args[1])
    elif args[:1] == ["--driver"]:
        out = driver_facts(args[1])
    elif args[:1] == ["--launch"]:
        out = launch_facts(args[1:])
    elif args[:1] == ["--slurm-names"]:
        out = slurm_name_facts(args[1:])
    else:
        out = {Path(p).name: recipe_facts(p) for p in args}
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
