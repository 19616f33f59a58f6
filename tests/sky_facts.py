"""Run by the SkyPilot venv (.venv-sky): load every recipe YAML with SkyPilot's own loaders
and print what the tests check, as JSON. SkyPilot lives in its own venv because its click
pin conflicts with wandb's and huggingface-hub's."""

import json
import sys
from pathlib import Path

import sky
from sky.utils import dag_utils


def task_facts(task) -> dict:
    resources = list(task.resources)
    return {
        "name": task.name,
        "num_nodes": task.num_nodes,
        "accelerators": sorted({a for r in resources for a in (r.accelerators or {})}),
        "accelerator_counts": sorted({n for r in resources for n in (r.accelerators or {}).values()}),
        "infras": sorted({str(r.cloud) for r in resources if r.cloud is not None}),
        "images": sorted({img for r in resources for img in (r.image_id or {}).values()}),
        "use_spot": sorted({r.use_spot for r in resources}),
        "docker_run_options": sorted(
            {o for r in resources for o in ((r.cluster_config_overrides or {}).get("docker", {}).get("run_options") or [])}
        ),
        "envs": task.envs,
        "secret_refs": [ref.name for ref in task._managed_secret_refs],
        "inline_secrets": sorted(task.secrets),
        "setup": task.setup,
        "run": task.run,
    }


def replacement_facts(recipe_path: str) -> dict:
    """The one-node task monarch-sky's SkyPilot host provider would launch for a lost node."""
    from monarch_sky.sky_hosts import load_recipe, replacement_task

    config = replacement_task(load_recipe(recipe_path), cluster="monarch-run-r0", port=26600)
    return task_facts(sky.Task.from_yaml_config(config))


def main(paths: list[str]) -> None:
    if paths and paths[0] == "--replacement":
        print(json.dumps(replacement_facts(paths[1])))
        return
    out = {}
    for path in paths:
        if dag_utils.is_job_group_yaml(path):
            dag = dag_utils.load_dag_from_yaml(path)
            out[Path(path).name] = {
                "job_group": True,
                "name": dag.name,
                "primary_tasks": dag.primary_tasks,
                "tasks": [task_facts(t) for t in dag.tasks],
            }
        else:
            out[Path(path).name] = {"job_group": False, **task_facts(sky.Task.from_yaml(path))}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
