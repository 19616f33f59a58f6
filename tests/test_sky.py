"""The SkyPilot path, offline: recipes validated by SkyPilot itself, `monarch-sky doctor`, and
`sky/bootstrap.sh` run end to end on simulated nodes (one process tree per node, each on its
own loopback address, with the SKYPILOT_* environment SkyPilot would give it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, Run, cli_env, leftovers, new_tag

SKY_PYTHON = REPO / ".venv-sky" / "bin" / "python"
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
AMD = {"MI300X", "MI325X", "MI355X"}


@pytest.fixture(scope="module")
def facts() -> dict:
    assert SKY_PYTHON.exists(), "SkyPilot's venv is missing: run `make test`, which builds .venv-sky"
    proc = subprocess.run(
        [str(SKY_PYTHON), str(REPO / "tests" / "sky_facts.py"), *map(str, RECIPES)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_amd_node_task(task: dict) -> None:
    assert set(task["accelerators"]) <= AMD and "MI300X" in task["accelerators"]
    assert task["accelerator_counts"] == [8]
    assert any(img.startswith("docker:rocm/pytorch") for img in task["images"])
    assert {"--device=/dev/kfd", "--device=/dev/dri", "--group-add=video"} <= set(task["docker_run_options"])
    assert task["inline_secrets"] == [], "no secret value may be written in a recipe"
    assert "sky/setup.sh" in task["setup"] and "sky/bootstrap.sh" in task["run"]


@pytest.mark.parametrize("name,recipe", [("llama.yaml", "llama3_8b"), ("llama-70b.yaml", "llama3_70b")])
def test_cluster_recipes_are_amd_rocm_and_call_the_bootstrap(facts, name, recipe):
    task = facts[name]
    assert not task["job_group"]
    assert_amd_node_task(task)
    assert task["num_nodes"] == 2
    assert {"Kubernetes", "OCI"} <= set(task["infras"])
    assert task["envs"]["RECIPE"] == recipe
    assert task["secret_refs"] == ["WANDB_API_KEY"]


def test_debug_recipe_runs_the_tiny_model_anywhere(facts):
    task = facts["debug.yaml"]
    assert task["accelerators"] == [] and task["num_nodes"] == 2
    assert task["envs"]["RECIPE"] == "llama3_tiny"
    assert "faults=kill@" in task["envs"]["MONARCH_SKY_ARGS"]
    assert "sky/bootstrap.sh" in task["run"]


def test_spot_recipe_is_a_job_group_with_one_spot_cluster_per_replica_group(facts):
    group = facts["llama-spot.yaml"]
    assert group["job_group"] and group["primary_tasks"] == ["controller"]
    controller, *workers = group["tasks"]
    assert controller["name"] == "controller" and controller["use_spot"] == [False]
    assert controller["accelerators"] == [] and controller["envs"]["MONARCH_SKY_ROLE"] == "controller"
    assert controller["secret_refs"] == ["WANDB_API_KEY"] and controller["inline_secrets"] == []
    assert controller["envs"]["GROUP_TASKS"].split() == [w["name"] for w in workers]
    assert len(workers) >= 2
    for worker in workers:
        assert_amd_node_task(worker)
        assert worker["use_spot"] == [True] and worker["num_nodes"] == 1
        assert worker["envs"]["MONARCH_SKY_ROLE"] == "worker"
        assert worker["envs"]["WORKER_TASK"] == worker["name"]


def test_skypilot_provider_builds_a_one_node_worker_task_from_the_recipe(facts):
    proc = subprocess.run(
        [str(SKY_PYTHON), str(REPO / "tests" / "sky_facts.py"), "--replacement", str(REPO / "recipes" / "llama.yaml")],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    task = json.loads(proc.stdout.strip().splitlines()[-1])
    recipe = facts["llama.yaml"]
    assert task["name"] == "monarch-run-r0" and task["num_nodes"] == 1
    assert task["accelerators"] == recipe["accelerators"] and task["infras"] == recipe["infras"]
    assert task["images"] == recipe["images"] and task["docker_run_options"] == recipe["docker_run_options"]
    assert task["envs"]["MONARCH_SKY_ROLE"] == "worker" and task["envs"]["WORKER_PORT"] == "26600"
    assert task["envs"]["RECIPE"] == recipe["envs"]["RECIPE"]
    assert task["secret_refs"] == [] and task["inline_secrets"] == [], "a worker needs no secrets"
    assert task["run"] == recipe["run"] and task["setup"] == recipe["setup"]


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "monarch_sky", "doctor", *args],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
    )


def test_doctor_on_cpu_reports_cpu_and_passes():
    proc = doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CPU only" in proc.stdout and "gloo" in proc.stdout


def test_doctor_names_the_node_whose_worker_does_not_answer():
    import socket

    with socket.socket() as up:
        up.bind(("127.0.0.1", 0))
        up.listen()
        alive = f"127.0.0.1:{up.getsockname()[1]}"
        proc = doctor("--workers", f"{alive},127.0.0.1:9", "--wait", "1")
    assert proc.returncode == 1
    assert "ok   node-0" in proc.stdout
    assert "FAIL node-1" in proc.stdout and "127.0.0.1:9" in proc.stdout


def bootstrap_env(tag: str, rank: int, nodes: int, tmp: Path, args: str) -> dict[str, str]:
    return {
        **cli_env(tag),
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NODE_IPS": "\n".join(f"127.0.0.{i + 1}" for i in range(nodes)),
        "SKYPILOT_NUM_NODES": str(nodes),
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "SKYPILOT_TASK_ID": tag,
        "RECIPE": "llama3_tiny",
        "PROCS_PER_REPLICA": "2",
        "WORKER_PORT": "26600",
        "MONARCH_SKY_PY": sys.executable,
        "MONARCH_SKY_STATE": str(tmp / f"state{rank}"),
        "MONARCH_SKY_ARGS": args,
    }


def test_bootstrap_trains_through_a_kill_across_simulated_nodes(tmp_path):
    tag, nodes = new_tag(), 3
    args = f"steps=40 faults=kill@15:1 run_dir={tmp_path / 'runs'} wandb.mode=disabled"
    procs = [
        subprocess.Popen(
            ["bash", str(REPO / "sky" / "bootstrap.sh")],
            cwd=REPO, env=bootstrap_env(tag, rank, nodes, tmp_path, args),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(nodes)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    run = Run(0, outputs[0], tmp_path / "runs" / tag, leftovers(tag))
    s = run.summary
    assert s["committed_steps"] == 40 and s["replicas"] == nodes
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == []
    [fault] = s["faults"]
    assert fault["kind"] == "kill" and fault["recovered_from"] == "peer"
    assert len(set(s["final_param_digest"].values())) == 1 and len(s["final_param_digest"]) == nodes
    hosts = next(e for e in run.events if e["event"] == "hosts_ready")["hosts"]
    assert hosts == [f"tcp://127.0.0.{i + 1}:26600" for i in range(nodes)]
    assert "[node 1 doctor]" in outputs[1] and "[node 1 worker 0]" in outputs[1]
    assert run.leftovers == [], run.leftovers


def test_bootstrap_refuses_to_run_outside_skypilot():
    env = {k: v for k, v in cli_env().items() if not k.startswith("SKYPILOT_")}
    proc = subprocess.run(
        ["bash", str(REPO / "sky" / "bootstrap.sh")], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "SKYPILOT_NODE_RANK is not set" in proc.stderr
