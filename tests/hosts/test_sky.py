"""The SkyPilot path, offline: recipes validated by SkyPilot itself, `monarch-sky doctor`, and
`sky/bootstrap.sh` run end to end on simulated nodes (one process tree per node, each on its
own loopback address, with the SKYPILOT_* environment SkyPilot would give it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from conftest import REPO, Run, cli_env, leftovers, new_tag, wait_for_event
from monarch_sky.hosts import tls
from monarch_sky.hosts.sky import TLS_SECRETS

SKY_PYTHON = REPO / ".venv-sky" / "bin" / "python"
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
AMD = {"MI300X", "MI300", "MI325X", "MI355X"}  # as SkyPilot's own AMD docs and clusters label them
# torch 2.13.0 (what monarch-sky pins), Python 3.11-3.13 (torchmonarch's and torchft's wheels)
PINNED_IMAGE = re.compile(r"docker:rocm/pytorch:rocm\d+\.\d+[.\d]*_ubuntu\d+\.\d+_py3\.1[123]_pytorch_release_2\.13\.0")


def sky_facts(*args: str) -> dict:
    """What SkyPilot 0.14.1's own code decides (tests/sky_facts.py, run in SkyPilot's venv)."""
    assert SKY_PYTHON.exists(), "SkyPilot's venv is missing: run `make test`, which builds .venv-sky"
    proc = subprocess.run(
        [str(SKY_PYTHON), str(REPO / "tests" / "sky_facts.py"), *args],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def facts() -> dict:
    return sky_facts(*map(str, RECIPES))


def assert_amd_node(task: dict, memory_gb: int) -> None:
    """Kubernetes (pinned ROCm image) or Slurm (setup.sh brings the stack), 8 AMD GPUs, the
    CPUs and memory an 8-GPU trainer needs, and no disk_size (Kubernetes: ephemeral storage)."""
    assert {c["cloud"] for c in task["candidates"]} == {"Kubernetes", "Slurm"}
    assert {a for c in task["candidates"] for a in c["accelerators"]} == AMD
    for c in task["candidates"]:
        assert list(c["accelerators"].values()) == [8]
        assert c["cpus"] == "64+" and c["memory"] == f"{memory_gb}+" and not c["disk_size_specified"]
        if c["cloud"] == "Kubernetes":
            assert PINNED_IMAGE.fullmatch(c["image"]), c["image"]
        else:
            assert c["image"] is None, "Slurm runs no container without Pyxis"
    assert task["inline_secrets"] == [], "no secret value may be written in a recipe"
    assert "sky/setup.sh" in task["setup"] and "sky/bootstrap.sh" in task["run"]


CLUSTER_RECIPES = [("llama.yaml", "llama3_8b", 512), ("llama-70b.yaml", "llama3_70b", 1024)]


@pytest.mark.parametrize("name,recipe,memory_gb", CLUSTER_RECIPES)
def test_cluster_recipes_ask_skypilot_for_amd_nodes_that_exist(facts, name, recipe, memory_gb):
    task = facts[name]
    # two replica groups and a hot spare node, which the bootstrap keeps out of the groups
    assert not task["job_group"] and task["num_nodes"] == 3 and task["envs"]["SPARE_NODES"] == "1"
    assert_amd_node(task, memory_gb)
    assert task["envs"]["RECIPE"] == recipe and task["envs"]["RECIPE_YAML"] == f"recipes/{name}"
    assert task["secret_refs"] == ["HF_TOKEN", *TLS_SECRETS] and task["optional_secrets"] == ["WANDB_API_KEY"]


def header_commands(recipe: Path) -> list[str]:
    """The shell commands a recipe's opening comment tells its user to run, in order."""
    commands = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith(("export ", "eval ", "sky ")):
            commands.append(text.split("  #")[0].strip())
    return commands


def run_header(commands: list[str], environ: dict) -> list[dict]:
    """Run the header's commands in one shell, with SkyPilot's venv first on PATH (its python3
    has `cryptography` and nothing of monarch-sky's stack); each `sky ...` is handed to
    SkyPilot's own CLI parsing and task building (sky_facts.py --launch)."""
    script = ["set -e"]
    for command in commands:
        if command.startswith("sky "):
            script.append(f"{SKY_PYTHON} tests/sky_facts.py --launch {command.removeprefix('sky ')} | tail -n 1")
        else:
            script.append(command)
    path = f"{SKY_PYTHON.parent}:{os.environ['PATH']}"
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**environ, "PATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_each_recipes_header_command_is_accepted_by_skypilot_as_written(recipe):
    commands = header_commands(recipe)
    assert sum(c.startswith("sky ") for c in commands) == 1, commands
    environ = {"HOME": os.environ["HOME"]}  # no HF_TOKEN, W&B key or CA of ours: the header's own
    [launch] = run_header(commands, environ)
    assert launch["error"] is None, launch["error"]
    for task in launch["tasks"].values():
        if "MONARCH_SKY_TLS_CA" in task["secrets"]:
            assert {"MONARCH_SKY_TLS_CA", "MONARCH_SKY_TLS_CA_KEY"} <= set(task["secrets"]) - set(task["empty_secrets"])


def test_the_command_for_a_node_that_came_back_is_accepted_by_skypilot_as_docs_cloud_gives_it():
    # docs/cloud.md: with the launch's own secrets (the same CA), every node runs the worker role.
    [command] = set(re.findall(r"`(sky exec <cluster> [^`]+)`", " ".join((REPO / "docs" / "cloud.md").read_text().split())))
    header = header_commands(REPO / "recipes" / "llama.yaml")
    [launch] = [c for c in header if c.startswith("sky launch")]
    secrets = " ".join(w for pair in re.findall(r"--secret \S+", launch) for w in pair.split())
    environ = {"HOME": os.environ["HOME"], "HF_TOKEN": "hf_x"}
    [facts] = run_header([*(c for c in header if not c.startswith("sky ")),
                          f"{command.replace('<cluster>', 'llama')} {secrets}"], environ)
    assert facts["error"] is None, facts["error"]
    [task] = facts["tasks"].values()
    assert task["role"] == "worker" and task["num_nodes"] == 3


def test_on_kubernetes_skypilot_cancels_every_node_for_a_failed_run_but_not_for_a_lost_pod():
    # What docs/cloud.md builds on, in the program SkyPilot's job driver runs on the head pod for
    # llama.yaml (its own code generates it): one Ray task per node in a STRICT_SPREAD placement
    # group; the first non-zero code cancels the others (hence a cluster node's bootstrap exits 0
    # when its worker is gone for good); a lost pod returns no code and its task has Ray's
    # default retries (no max_retries), which wait for a bundle no surviving node may take.
    proc = subprocess.run([str(SKY_PYTHON), "tests/sky_facts.py", "--driver", "recipes/llama.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = json.loads(proc.stdout.splitlines()[-1])["code"]
    node_tasks = [line for line in code.splitlines() if line.strip().startswith(".options(name=name_str")]
    assert len(node_tasks) == 3 and not any("max_retries" in line for line in node_tasks), node_tasks
    assert "'STRICT_SPREAD'" in code or '"STRICT_SPREAD"' in code
    cancel = code[code.index("if res['return_code'] != 0:"):code.index("ray.cancel(task, force=True)")]
    assert "failed = True" in cancel and "if failed:" in cancel, cancel


def test_a_launch_without_the_ca_is_refused_by_skypilot_naming_the_missing_secrets():
    """The check above bites: the llama header without its CA is what the recipes said before."""
    commands = [c.replace(" --secret MONARCH_SKY_TLS_CA --secret MONARCH_SKY_TLS_CA_KEY", "")
                for c in header_commands(REPO / "recipes" / "llama.yaml") if not c.startswith("eval ")]
    [launch] = run_header(commands, {"HOME": os.environ["HOME"]})
    assert "No value available for secret(s): MONARCH_SKY_TLS_CA, MONARCH_SKY_TLS_CA_KEY" in launch["error"]


def test_the_rdma_pod_config_the_kubernetes_page_shows_is_accepted_by_skypilot(tmp_path):
    page = (REPO / "docs" / "kubernetes.md").read_text()
    block = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    recipe = tmp_path / "llama-rdma.yaml"
    text = (REPO / "recipes" / "llama.yaml").read_text()
    head, rest = text.split("config:\n", 1)  # the page's block takes the place of the recipe's own
    recipe.write_text(head + block + rest.split("\n\n", 1)[1])
    pods = sky_facts("--pod", str(recipe))["containers"]
    assert len(pods) == 4, "one Kubernetes candidate per AMD accelerator name"
    for containers in pods:  # SkyPilot merges lists item by item: the pod's one container gets it
        [container] = containers
        assert container["resources"]["limits"] == {"amd.com/gpu": 8, "rdma/rdma_shared_device_a": 1}
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert RAYLET_WAITS in container["env"], "the recipe's own pod_config stays in the page's block"


RAYLET_WAITS = {"name": "RAY_gcs_rpc_server_reconnect_timeout_s", "value": "86400"}


@pytest.mark.parametrize("name", ["llama.yaml", "llama-70b.yaml"])
def test_kubernetes_pods_keep_their_raylet_when_node_0_is_lost(name):
    """Each pod's `run` is a child of a Ray worker, which SkyPilot's watchdog follows; the raylet
    gives up 60 s after the head pod is gone unless told to wait (docs/cloud.md)."""
    pods = sky_facts("--pod", str(REPO / "recipes" / name))["containers"]
    assert pods and all(RAYLET_WAITS in containers[0]["env"] for containers in pods), pods


@pytest.mark.parametrize("label", ["mi300x", "mi300", "mi325x", "mi355x"])
@pytest.mark.parametrize("name,memory_gb", [("llama.yaml", 512), ("llama-70b.yaml", 1024)])
def test_kubernetes_schedules_the_recipes_on_labelled_amd_nodes(label, name, memory_gb):
    """SkyPilot's feasibility check and pod variables, on fake MI300X-class nodes with 400 GiB
    of ephemeral storage (typical; a disk_size of 512 would make every candidate infeasible)."""
    fits = [c for c in sky_facts("--k8s", f"recipes/{name}", label)["candidates"] if c["instance_types"]]
    assert len(fits) == 1, fits
    [fit] = fits
    assert fit["label"] == ["skypilot.co/accelerator", [label]]
    pod = fit["pod"]
    assert (float(pod["cpus"]), float(pod["memory"])) == (64, memory_gb)
    assert pod["accelerator_count"] == "8" and pod["k8s_resource_key"] == "amd.com/gpu"
    assert pod["k8s_ephemeral_storage"] is None
    assert PINNED_IMAGE.fullmatch("docker:" + pod["image_id"])


def test_a_bucket_mounted_as_the_recipe_says_keeps_the_run_record(tmp_path):
    """The recipe's own instructions (its RUN_DIR comment) as SkyPilot reads them: the bucket is
    mounted where RUN_DIR points, in the mode that lets the run record's files be appended to."""
    text = (REPO / "recipes" / "llama.yaml").read_text()
    [mount] = [line.split("#", 1)[1].strip() for line in text.splitlines() if "file_mounts:" in line]
    [run_dir] = [line.split("RUN_DIR=", 1)[1].strip() for line in text.splitlines() if "--env RUN_DIR=" in line]
    variant = text.replace('  RUN_DIR: ""', f"  RUN_DIR: {run_dir}") + mount + "\n"
    (tmp_path / "kept.yaml").write_text(variant)
    task = sky_facts(str(tmp_path / "kept.yaml"))["kept.yaml"]
    assert task["envs"]["RUN_DIR"] == run_dir
    assert task["storage_mounts"] == {run_dir: {"name": "my-bucket", "mode": "MOUNT_CACHED"}}


def test_a_disk_size_makes_kubernetes_refuse_the_recipe(tmp_path):
    """The control for the test above: what the recipes asked for before (disk_size: 512)."""
    recipe = (REPO / "recipes" / "llama.yaml").read_text().replace("resources:\n", "resources:\n  disk_size: 512\n", 1)
    (tmp_path / "disk.yaml").write_text(recipe)
    fits = [c for c in sky_facts("--k8s", str(tmp_path / "disk.yaml"), "mi300x")["candidates"] if c["instance_types"]]
    assert fits == []


def test_slurm_gres_types_match_the_recipe_names():
    gres = ["mi300x", "amd_mi300x", "MI300X", "mi300", "mi325x", "mi355x"]
    matches = sky_facts("--slurm-names", *gres)
    assert all(matches[g] for g in gres), matches


def test_debug_recipe_runs_the_tiny_model_anywhere(facts):
    task = facts["debug.yaml"]
    assert [c["accelerators"] for c in task["candidates"]] == [{}] and task["num_nodes"] == 2
    assert task["envs"]["RECIPE"] == "llama3_tiny"
    assert "faults=kill@" in task["envs"]["MONARCH_SKY_ARGS"]
    assert "sky/bootstrap.sh" in task["run"]


def test_job_group_recipe_stays_on_one_kubernetes_cluster_and_recovers_lost_groups(facts):
    group = facts["llama-group.yaml"]
    assert group["job_group"] and group["primary_tasks"] == ["controller"]
    assert group["inter_connection"] is True and group["networking_degraded"] is False
    controller, *workers = group["tasks"]
    assert controller["name"] == "controller" and controller["envs"]["MONARCH_SKY_ROLE"] == "controller"
    assert [c["accelerators"] for c in controller["candidates"]] == [{}]
    assert controller["secret_refs"] == ["HF_TOKEN", *TLS_SECRETS] and controller["inline_secrets"] == []
    assert controller["optional_secrets"] == ["WANDB_API_KEY"]
    assert controller["envs"]["GROUP_TASKS"].split() == [w["name"] for w in workers] and len(workers) >= 2
    for task in group["tasks"]:
        for c in task["candidates"]:
            assert c["cloud"] == "Kubernetes" and c["use_spot"] is False
            assert c["job_recovery"]["strategy"] == "FAILOVER" and c["job_recovery"]["max_restarts_on_errors"] >= 1
    for worker in workers:
        assert {a for c in worker["candidates"] for a in c["accelerators"]} == AMD
        assert all(PINNED_IMAGE.fullmatch(c["image"]) and c["cpus"] == "64+" for c in worker["candidates"])
        assert all(c["job_recovery"]["recover_on_exit_codes"] == [75] for c in worker["candidates"])
        assert worker["num_nodes"] == 1 and worker["envs"]["MONARCH_SKY_ROLE"] == "worker"
        assert worker["envs"]["WORKER_TASK"] == worker["name"]
        assert worker["secret_refs"] == ["HF_TOKEN", *TLS_SECRETS] and worker["inline_secrets"] == []
        assert worker["envs"]["RECIPE"] == controller["envs"]["RECIPE"]  # setup fetches its tokenizer
        # sky/bootstrap.sh advertises and finds each group as $WORKER_TASK-0.$SKYPILOT_JOBGROUP_NAME
        assert group["addresses"][worker["name"]] == f"{worker['name']}-0.{group['name']}"


@pytest.mark.parametrize("cloud,region,candidate", [("Kubernetes", "amd-ctx", "Kubernetes"), ("Slurm", "mycluster", "Slurm")])
def test_skypilot_provider_replaces_a_node_on_the_same_infra_and_region(facts, cloud, region, candidate):
    info = json.dumps({"cluster_name": "monarch", "cloud": cloud, "region": region, "zone": None})
    task = sky_facts("--replacement", str(REPO / "recipes" / "llama.yaml"), info)
    recipe = facts["llama.yaml"]
    assert task["name"] == "monarch-run-r0" and task["num_nodes"] == 1
    assert {c["cloud"] for c in task["candidates"]} == {candidate}
    assert {c["region"] for c in task["candidates"]} == {region}
    same = [c for c in recipe["candidates"] if c["cloud"] == candidate]
    assert {(c["image"], c["cpus"], c["memory"]) for c in task["candidates"]} == {
        (c["image"], c["cpus"], c["memory"]) for c in same}
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


RUN_CA = dict(zip((tls.CA_ENV, tls.CA_KEY_ENV), map(tls.as_secret, tls.new_ca())))


class KeyHolders:
    """Scans, while a run lasts, which workers and processes they started (the trainers) hold
    MONARCH_SKY_TLS_CA_KEY."""

    def __init__(self, tag: str):
        self.tag, self.with_key, self.workers_seen, self.trainers_seen = tag, [], False, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._scan, daemon=True)
        self._thread.start()

    def _scan(self) -> None:
        while not self._done.wait(0.5):
            for p in psutil.process_iter(["pid", "cmdline"]):
                try:
                    env, cmd = p.environ(), " ".join(p.info["cmdline"] or [])
                    if env.get("MONARCH_SKY_TEST_TAG") != self.tag:
                        continue
                    lineage = [cmd] + [" ".join(a.cmdline()) for a in p.parents()]
                except (psutil.Error, OSError):
                    continue
                if not any("monarch_sky worker" in c for c in lineage):
                    continue  # the bootstrap shells and the controller keep the key
                self.workers_seen |= "monarch_sky worker" in cmd
                self.trainers_seen |= "RANK" in env and "TORCHFT_LIGHTHOUSE" in env
                if tls.CA_KEY_ENV in env and cmd not in self.with_key:
                    self.with_key.append(cmd[:200])

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)


def bootstrap_env(tag: str, rank: int, nodes: int, tmp: Path, args: str, **extra: str) -> dict[str, str]:
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
        **RUN_CA,  # the run's CA, as the recipes' secrets bring it: workers and controller speak TLS
        **extra,
    }


def start_nodes(tag: str, nodes: int, tmp: Path, args: str, own_memory: bool = False, **extra: str) -> list:
    """`sky/bootstrap.sh` on each of `nodes` simulated nodes, output piped. `own_memory`: each
    node has node memory of its own (tmp/memoryN) and a session of its own (to lose it whole)."""
    def env(rank: int) -> dict:
        memory = {"MONARCH_SKY_NODE_MEMORY": str(tmp / f"memory{rank}")} if own_memory else {}
        return bootstrap_env(tag, rank, nodes, tmp, args, **extra, **memory)

    return [subprocess.Popen(["bash", str(REPO / "sky" / "bootstrap.sh")], cwd=REPO, env=env(rank),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=own_memory)
            for rank in range(nodes)]


@pytest.mark.parametrize(
    "nodes, per_group",
    [pytest.param(3, 1, id="group-per-node"), pytest.param(4, 2, id="groups-span-2-nodes", marks=pytest.mark.e2e)],
)
def test_bootstrap_trains_through_a_kill_across_simulated_nodes(tmp_path, nodes, per_group):
    tag, replicas = new_tag(), nodes // per_group
    args = f"steps=40 faults=kill@15:1 run_dir={tmp_path / 'runs'} wandb.mode=disabled"
    procs = start_nodes(tag, nodes, tmp_path, args, HOSTS_PER_REPLICA=str(per_group), PROCS_PER_REPLICA=str(2 // per_group))
    outputs, holders = [], KeyHolders(tag)
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600)[0])
    finally:
        holders.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    # The CA key signs certificates for any address: only the bootstrap shells and the controller hold it.
    assert holders.workers_seen and holders.trainers_seen, "test premise: the scan saw the workers and trainers"
    assert holders.with_key == [], f"processes that hold the CA key but never sign: {holders.with_key}"
    run = Run(0, outputs[0], tmp_path / "runs" / tag, leftovers(tag))
    s = run.summary
    assert s["committed_steps"] == 40 and (s["replicas"], s["hosts_per_replica"]) == (replicas, per_group)
    assert s["unplanned_failures"] == [] and s["lost_replicas"] == []
    [fault] = s["faults"]
    assert fault["kind"] == "kill" and fault["recovered_from"] == "peer"
    assert len(set(s["final_param_digest"].values())) == 1 and len(s["final_param_digest"]) == replicas
    hosts = next(e for e in run.events if e["event"] == "hosts_ready")["hosts"]
    assert hosts == [f"tls://127.0.0.{i + 1}:26600" for i in range(nodes)]
    # consecutive nodes form a group: group 1 spans nodes 2 and 3 when groups span 2 nodes
    started = {e["replica"]: e["hosts"] for e in run.events if e["event"] == "replica_started" and e["generation"] == 0}
    assert started[1] == hosts[per_group:2 * per_group]
    assert "[node 1 doctor]" in outputs[1] and "[node 1 worker 0]" in outputs[1]
    assert run.leftovers == [], run.leftovers


@pytest.mark.e2e  # ~2 min of simulated nodes
def test_a_node_whose_worker_dies_moves_to_the_spare_node_and_comes_back_as_the_new_spare(tmp_path):
    # Three simulated nodes with SPARE_NODES=1: two groups and a spare. Node 1's worker dies with
    # everything it started (a crash of that node's stack); its group moves onto node 2's warm
    # spare, and node 1's bootstrap starts the worker again 100 ports higher, where the pool
    # finds it by itself: it is the new spare, and the run releases it at the end.
    tag, nodes = new_tag(), 3
    args = f"steps=150 faults=none run_dir={tmp_path / 'runs'} wandb.mode=disabled"
    procs = start_nodes(tag, nodes, tmp_path, args, SPARE_NODES="1")
    events = tmp_path / "runs" / tag / "events.jsonl"
    try:
        wait_for_event(events, "training_started", timeout_s=400)
        worker = psutil.Process(int((tmp_path / "state1" / "worker-26600.pid").read_text()))
        doomed = [worker, *worker.children(recursive=True)]
        for proc in doomed:
            proc.kill()
        outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    run = Run(0, outputs[0], tmp_path / "runs" / tag, leftovers(tag))
    s = run.summary
    assert (s["replicas"], s["committed_steps"], s["lost_replicas"]) == (2, 150, [])
    assert len(set(s["final_param_digest"].values())) == 1 and len(s["final_param_digest"]) == 2
    [lost] = [e for e in run.events if e["event"] == "host_lost"]
    [replaced] = [e for e in run.events if e["event"] == "host_replaced"]
    assert lost["host"] == "tls://127.0.0.2:26600"
    assert (replaced["host"], replaced["spare"], replaced["warm"]) == ("tls://127.0.0.3:26600", True, True)
    ready = [e["host"] for e in run.events if e["event"] == "spare_ready"]
    assert ready == ["tls://127.0.0.3:26600", "tls://127.0.0.2:26700"], "node 1 came back as the spare"
    [rejoined] = [e for e in run.events if e["event"] == "replica_rejoined"]
    assert rejoined["replica"] == 1 and rejoined["recovered_from"] == "peer"
    assert "starting it again on port 26700" in outputs[1]
    assert s["spares"] == {"size": 1, "used": 1, "ready": 1, "warm": True}
    assert run.leftovers == [], run.leftovers


def test_bootstrap_refuses_to_run_outside_skypilot():
    env = {k: v for k, v in cli_env().items() if not k.startswith("SKYPILOT_")}
    proc = subprocess.run(
        ["bash", str(REPO / "sky" / "bootstrap.sh")], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "SKYPILOT_NODE_RANK is not set" in proc.stderr


@pytest.mark.e2e  # ~3 min of simulated nodes
def test_losing_node_0_with_the_controller_the_next_nodes_standby_takes_the_run_over(tmp_path):
    # Three simulated nodes with SPARE_NODES=1, each with its own node memory. Node 0 (the
    # controller, group 0) is lost whole: every process of its tree, and its memory. Node 1's
    # standby no longer hears node 0's controller door and takes over: it finds group 1's state
    # in node 1's memory, the groups' data positions in the controller's notes, passes over the
    # dead node (group 0 now trains on node 1, group 1 on the spare node 2, healed from node 1)
    # and trains on to the target, with no checkpoint and no bucket.
    tag, nodes = new_tag(), 3
    args = f"steps=120 faults=none run_dir={tmp_path / 'runs'} wandb.mode=disabled"
    procs = start_nodes(tag, nodes, tmp_path, args, own_memory=True, SPARE_NODES="1", TAKEOVER_AFTER_S="5")
    events = tmp_path / "runs" / tag / "events.jsonl"
    try:
        wait_for_event(events, "progress", timeout_s=400, count=5)  # past step 25: snapshots and notes are out
        node0 = psutil.Process(procs[0].pid)
        for proc in [node0, *node0.children(recursive=True)]:  # a power cut: node 0 and all it ran
            proc.kill()
        shutil.rmtree(tmp_path / "memory0")
        outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank in (1, 2):
        assert procs[rank].returncode == 0, f"node {rank}:\n{outputs[rank][-3000:]}"
    assert "this node takes the run over" in outputs[1] and "takes the run over" not in outputs[2]
    run = Run(0, outputs[1], tmp_path / "runs" / tag, leftovers(tag))
    s = run.summary
    assert s["committed_steps"] == 120 and s["outcome"]["status"] == "ok", s["outcome"]
    lost = s["controller_lost"]
    assert lost["restored_from"] == "memory" and lost["steps_lost"] <= 10 and lost["loaded_by"] == [0], lost
    assert s["checkpoints_written"] == 0 and s["lost_replicas"] == []
    assert len(set(s["final_param_digest"].values())) == 1 and len(s["final_param_digest"]) == 2
    started = {e["replica"]: e["hosts"] for e in run.events
               if e["event"] == "replica_started" and e["wall"] > lost_at(run)}
    assert started == {0: ["tls://127.0.0.2:26600"], 1: ["tls://127.0.0.3:26600"]}, started
    assert run.leftovers == [], run.leftovers


def lost_at(run) -> float:
    """When the controller that took over started (its `controller_restarted` event)."""
    return next(e["wall"] for e in run.events if e["event"] == "controller_restarted")
