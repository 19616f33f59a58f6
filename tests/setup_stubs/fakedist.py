"""Tiny stand-ins for installed distributions (torch, triton, ...) that `sky/setup.sh` can inspect.

Each is a package that imports in milliseconds plus a dist-info that importlib.metadata reads,
written into a site-packages directory: the test's "image" or what the stub uv "installs".
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

# distribution -> the module it installs, where the two names differ
MODULES = {"torchmonarch": "monarch", "triton-rocm": "triton", "pytorch-triton-rocm": "triton",
           "pyyaml": "yaml"}


def normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def install(site: Path, dist: str, version: str, hip: str | None = None, package: bool = True) -> None:
    """Write `dist` at `version` into `site` (without its package if not `package`); torch also
    gets `torch.version.hip`."""
    dist = normalize(dist)
    module = MODULES.get(dist, dist.replace("-", "_"))
    if package:
        (site / module).mkdir(parents=True, exist_ok=True)
        init = f"__version__ = {version!r}\n"
        if dist == "torch":
            (site / module / "version.py").write_text(f"__version__ = {version!r}\nhip = {hip!r}\n")
            init = "from torch import version\n__version__ = version.__version__\n"
        (site / module / "__init__.py").write_text(init)
    for old in site.glob(f"{dist.replace('-', '_')}-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(module + "\n")
    (info / "RECORD").write_text("")


def installed(site: Path) -> dict[str, str]:
    """{distribution: version} of what `site` itself holds (what uv sees: not what .pth files add)."""
    found = {}
    for info in site.glob("*.dist-info"):
        fields = dict(line.split(": ", 1) for line in (info / "METADATA").read_text().splitlines() if ": " in line)
        found[normalize(fields["Name"])] = fields["Version"]
    return found


def make_venv(path: Path) -> Path:
    """A real venv without pip, on the interpreter running this; returns its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return site_packages(path)


def site_packages(venv: Path) -> Path:
    (site,) = venv.glob("lib/python*/site-packages")
    return site
