"""`sky/setup.sh` on simulated fresh nodes, offline: the script's own logic runs for real, with
a stub uv (tests/setup_stubs/uv.py) that records each call and "installs" tiny fake packages.

A node is a PATH whose `python3` is a real venv holding fake distributions: no torch (a bare node
with Python 3.10), or an image's torch and triton. Like uv, the stub builds the setup venv on the
base interpreter, so an image's packages are only seen through the layer setup.sh adds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "setup_stubs"))
import fakedist  # noqa: E402

ROCM_INDEX = "https://download.pytorch.org/whl/rocm7.2"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ROCM_STACK = {"torch": ("2.13.0+rocm7.2", "7.2"), "triton-rocm": ("3.7.1", None)}  # PyTorch's wheels
AMD_IMAGE_STACK = {"torch": ("2.13.0+rocm10.0.0", "10.0.0"), "triton": ("3.8.0+git5a1b2c3d.rocm10.0.0", None)}
# A sitecustomize that makes a python say it is 3.10 (sysconfig first: its paths stay real)
PYTHON_310 = """import collections, sys, sysconfig
fields = "major minor micro releaselevel serial"
sys.version_info = collections.namedtuple("version_info", fields)(3, 10, 12, "final", 0)
"""


@dataclass
class Setup:
    returncode: int
    output: str
    calls: list[dict]  # the stub uv's log: argv and what it installed
    venv: Path

    def venv_python(self) -> str:
        """The --python setup asked `uv venv` for."""
        (argv,) = [c["argv"] for c in self.calls if c["argv"][0] == "venv"]
        return argv[argv.index("--python") + 1]

    def venv_options(self) -> list[str]:
        return [arg for c in self.calls if c["argv"][0] == "venv" for arg in c["argv"]]

    def pip_installs(self) -> list[list[str]]:
        return [c["argv"] for c in self.calls if c["argv"][:2] == ["pip", "install"] and "--help" not in c["argv"]]

    def installed(self) -> list[str]:
        return [spec for c in self.calls for spec in c["installed"]]


def run_setup(tmp_path: Path, image: dict | None = None, gpus: int | None = 8, env: dict | None = None,
              python: str = "") -> Setup:
    """Run sky/setup.sh on a node whose python3 holds `image` ({dist: (version, hip)}; None: a
    bare node) and whose sitecustomize is `python`, with `gpus` in SKYPILOT_SETUP_NUM_GPUS_PER_NODE."""
    node_site = fakedist.make_venv(tmp_path / "node")
    for dist, (version, hip) in (image or {}).items():
        fakedist.install(node_site, dist, version, hip=hip)
    if python:
        (node_site / "sitecustomize.py").write_text(python)
    home = tmp_path / "home"
    uv = home / ".local" / "bin" / "uv"  # where SkyPilot installs uv on every node
    uv.parent.mkdir(parents=True)
    uv.write_text(f'#!/bin/bash\nexec "{sys.executable}" "{REPO / "tests" / "setup_stubs" / "uv.py"}" "$@"\n')
    uv.chmod(0o755)
    log = tmp_path / "uv.log"
    full_env = {
        "PATH": f"{tmp_path / 'node' / 'bin'}:/usr/bin:/bin",
        "HOME": str(home),
        "MONARCH_SKY_VENV": str(tmp_path / "venv"),
        "UV_STUB_LOG": str(log),
        **({} if gpus is None else {"SKYPILOT_SETUP_NUM_GPUS_PER_NODE": str(gpus)}),
        **(env or {}),
    }
    proc = subprocess.run(["/bin/bash", str(REPO / "sky" / "setup.sh")], env=full_env, capture_output=True,
                          text=True, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return Setup(proc.returncode, proc.stdout + proc.stderr, calls, tmp_path / "venv")


def excludes(setup: Setup) -> set[str]:
    return set((setup.venv / "monarch-sky-excludes.txt").read_text().split())


def test_bare_gpu_node_gets_its_own_python_and_pytorch_rocm_wheels(tmp_path):
    node = run_setup(tmp_path, image=None, gpus=8, python=PYTHON_310)
    assert node.returncode == 0, node.output
    python3 = [str(tmp_path / "node" / "bin" / "python3"), "-c", "import sys; print(sys.version_info[:2])"]
    assert subprocess.run(python3, capture_output=True, text=True).stdout.strip() == "(3, 10)"
    assert node.venv_python() == "3.12"  # uv's own CPython, not the node's 3.10
    torch = node.pip_installs()[0]
    assert torch[torch.index("--index-url") + 1] == ROCM_INDEX
    assert {"torch==2.13.0", "triton-rocm==3.7.1"} <= set(torch), torch
    assert {"torch", "triton"} <= excludes(node)  # the rest never brings PyPI's (CUDA) triton
    assert not [spec for spec in node.installed() if spec.startswith("triton==")], node.installed()
    assert "torch 2.13.0+rocm7.2 (hip 7.2), triton triton-rocm 3.7.1" in node.output


def test_bare_cpu_node_gets_cpu_wheels_and_pypi_triton(tmp_path):
    node = run_setup(tmp_path, image=None, gpus=0, python=PYTHON_310)
    assert node.returncode == 0, node.output
    assert node.venv_python() == "3.12"
    torch = node.pip_installs()[0]
    assert torch[torch.index("--index-url") + 1] == CPU_INDEX and "torch==2.13.0" in torch, torch
    assert not any("triton-rocm" in arg for argv in node.pip_installs() for arg in argv)
    assert "triton==3.9.0" in node.installed()  # torchtitan imports triton, even on CPU
    assert "torch 2.13.0+cpu (hip None)" in node.output


def test_image_with_another_torch_stops_naming_the_fix(tmp_path):
    node = run_setup(tmp_path, image={"torch": ("2.12.0", "6.4"), "triton-rocm": ("3.6.0", None)})
    assert node.returncode != 0
    assert "monarch-sky setup: torch 2.12.0" in node.output and "is not torch 2.13.0" in node.output
    assert "fix: use an image with Python 3.11-3.13 and torch 2.13.0" in node.output
    assert "TORCH_SPEC=torch==2.13.0" in node.output
    assert node.pip_installs() == []  # stopped before installing anything


@pytest.mark.parametrize("tritons", [
    {"triton": ("3.9.0", None)},                                  # PyPI's instead of triton-rocm
    {"triton-rocm": ("3.7.1", None), "triton": ("3.9.0", None)},  # PyPI's over triton-rocm
], ids=["instead", "over"])
def test_image_with_pypi_triton_stops(tmp_path, tritons):
    node = run_setup(tmp_path, image={"torch": ("2.13.0+rocm7.2", "7.2"), **tritons})
    assert node.returncode != 0
    assert "monarch-sky setup: " in node.output and "PyPI's" in node.output, node.output
    assert "triton 3.9.0" in node.output and "CUDA" in node.output
    if "triton-rocm" in tritons:
        assert "uninstall PyPI's triton" in node.output
    assert node.pip_installs() == []


@pytest.mark.parametrize("stack", [ROCM_STACK, AMD_IMAGE_STACK], ids=["pytorch-wheels", "amd-image"])
def test_image_with_the_right_stack_is_used_not_replaced(tmp_path, stack):
    node = run_setup(tmp_path, image=stack)
    assert node.returncode == 0, node.output
    assert node.venv_python() == str(tmp_path / "node" / "bin" / "python3")
    assert "--system-site-packages" in node.venv_options()
    replaced = [s for s in node.installed() if s.split("==")[0] in ("torch", "triton", "triton-rocm")]
    assert replaced == []
    assert {"torch", "triton"} <= excludes(node)
    torch, hip = stack["torch"]
    assert f"torch {torch} (hip {hip})" in node.output  # the image's, seen through setup's layer


def test_image_on_python_310_stops(tmp_path):
    node = run_setup(tmp_path, image=ROCM_STACK, python=PYTHON_310)
    assert node.returncode != 0
    assert "is Python 3.10; monarch-sky needs 3.11-3.13" in node.output, node.output
    assert "fix: use an image with Python 3.11-3.13" in node.output


@pytest.mark.parametrize("gpu_env", [
    {"SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "8"},  # what SkyPilot gives `setup`
    {"SKYPILOT_NUM_GPUS_PER_NODE": "8"},        # `run`'s name, the fallback
], ids=["setup-var", "run-var"])
def test_gpu_node_refuses_a_cpu_torch(tmp_path, gpu_env):
    node = run_setup(tmp_path, image={"torch": ("2.13.0+cpu", None)}, gpus=None, env=gpu_env)
    assert node.returncode != 0
    assert "torch 2.13.0+cpu is not a ROCm build" in node.output and "8 GPUs" in node.output, node.output


def test_cpu_node_takes_a_cpu_torch(tmp_path):
    node = run_setup(tmp_path, image={"torch": ("2.13.0+cpu", None)}, gpus=0)
    assert node.returncode == 0, node.output
    assert "triton==3.9.0" in node.installed()


def test_torch_spec_takes_the_wheel_path_on_an_image(tmp_path):
    node = run_setup(tmp_path, image=ROCM_STACK, env={"TORCH_SPEC": "torch==2.13.0+rocm7.2"})
    assert node.returncode == 0, node.output
    assert node.venv_python() == "3.12" and "--system-site-packages" not in node.venv_options()
    torch = node.pip_installs()[0]
    assert torch[torch.index("--index-url") + 1] == ROCM_INDEX and "torch==2.13.0+rocm7.2" in torch


def test_uv_without_excludes_stops(tmp_path):
    node = run_setup(tmp_path, image=ROCM_STACK, env={"STUB_UV_NO_EXCLUDES": "1"})
    assert node.returncode != 0
    assert "has no 'uv pip install --excludes'" in node.output and "self update" in node.output
    assert node.venv_options() == []


def test_nodes_sharing_a_home_build_the_venv_once(tmp_path):
    """Slurm runs setup on every node at once, often on a shared home: one node builds the
    venv, the others wait for it and reuse it; a change of settings builds it again."""
    first = run_setup(tmp_path / "a", image=None, gpus=0)
    assert first.returncode == 0, first.output
    again = rerun_setup(tmp_path / "a", gpus=0)
    assert again.returncode == 0 and "is ready" in again.output, again.output
    other = rerun_setup(tmp_path / "a", gpus=0, env={"TORCH_SPEC": "torch==2.13.0+cpu"})
    assert other.returncode == 0 and "is ready" not in other.output, other.output


def rerun_setup(tmp_path: Path, gpus: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """sky/setup.sh again on the node `run_setup` made under `tmp_path` (its home and venv)."""
    proc = subprocess.run(
        ["/bin/bash", str(REPO / "sky" / "setup.sh")], capture_output=True, text=True, timeout=120,
        env={"PATH": f"{tmp_path / 'node' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path / "home"),
             "MONARCH_SKY_VENV": str(tmp_path / "venv"), "UV_STUB_LOG": str(tmp_path / "uv2.log"),
             "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": str(gpus), **(env or {})},
    )
    proc.output = proc.stdout + proc.stderr
    return proc
