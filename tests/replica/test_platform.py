"""Each replica group decides its platform on its own host, never on the controller's.

In a job group the controller is a CPU task while the groups run on AMD GPUs: a spec built
from the controller's platform would give the GPU trainers gloo, fp32 and no activation
checkpointing. These tests build TorchTitan's real config for each platform.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO, cli_env
from monarch_sky.common import platform as platform_mod
from monarch_sky.config import load_job
from monarch_sky.control.context import RunContext, trainer_env
from monarch_sky.hosts.base import Host


def context(tmp_path) -> RunContext:
    job = load_job(["recipe=llama3_debug"])
    cpu = platform_mod.Platform("cpu", "gloo", 0, (), "")  # the controller runs on a CPU node
    record = SimpleNamespace(path=tmp_path)
    return RunContext(job.config, provider=None, record=record, tracker=None, display=None, platform=cpu)


def test_controller_leaves_the_platform_and_threads_to_each_replica_host(tmp_path):
    ctx = context(tmp_path)
    spec = ctx.spec(0)
    assert spec.platform_kind == ""
    assert spec.on_host("rocm").platform_kind == "rocm"
    assert spec.on_host("rocm").on_host("cpu").platform_kind == "rocm", "a named platform is kept"
    env = ctx.proc_env([Host(name="n1", ip="10.0.0.2", port=26600)])
    assert "OMP_NUM_THREADS" not in env, "a CPU controller must not limit GPU trainers' threads"
    assert env[platform_mod.ADVERTISE_ENV] == "10.0.0.2"
    # A group on two hosts: each host's worker gives its own processes their address.
    assert platform_mod.ADVERTISE_ENV not in ctx.proc_env([Host("n1", "10.0.0.2", 26600), Host("n2", "10.0.0.3", 26600)])
    assert trainer_env(ctx.cfg, ctx.platform)["OMP_NUM_THREADS"] == "1"


def test_groups_on_other_accelerators_are_refused_with_the_reason(tmp_path):
    ctx = context(tmp_path)
    assert ctx.refuse_platform("rocm x8") is None
    assert ctx.refuse_platform("rocm x8") is None
    reason = ctx.refuse_platform("cpu")
    assert reason is not None and "cpu" in reason and "rocm x8" in reason
    assert ctx.replica_platform == "rocm x8"


BUILD = """
import json, sys
from monarch_sky.common import platform as platform_mod
from monarch_sky.config import load_job
from monarch_sky.recipes import RECIPES, TrainerSpec

platform_mod.prepare_torchtitan(platform_mod.detect())
job = load_job(["recipe=llama3_debug"])
spec = TrainerSpec.from_job(job.config, 0, "/tmp/unused").on_host(sys.argv[1])
c = RECIPES["llama3_debug"].build_trainer(spec)
attention = type(c.model_spec.model.layers[0].attention.inner_attention).__qualname__
print(json.dumps({
    "precision": c.training.mixed_precision_param,
    "activation_checkpoint": c.activation_checkpoint is not None,
    "process_group": c.fault_tolerance.process_group,
    "attention": attention,
}))
"""


@pytest.mark.parametrize("kind,expected", [
    ("rocm", {"precision": "bfloat16", "activation_checkpoint": True, "process_group": "nccl"}),
    ("cpu", {"precision": "float32", "activation_checkpoint": False, "process_group": "gloo"}),
])
def test_the_trainer_config_follows_the_hosts_platform(kind, expected):
    proc = subprocess.run(
        [sys.executable, "-c", BUILD, kind], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: built[k] for k in expected} == expected
    assert ("Flex" in built["attention"]) == (kind != "cpu"), built["attention"]
