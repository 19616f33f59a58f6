"""A stand-in for uv that `sky/setup.sh` runs in tests: offline, instant, and it keeps a record.

Each call appends {"argv": [...], "installed": [...]} to $UV_STUB_LOG. It does what setup.sh asks
of uv, with fake packages (fakedist.py) in place of real ones:
  uv venv [--clear] [--system-site-packages] --python X DIR
      a real venv without pip, on the interpreter running this stub, whatever X asks for (the
      test reads X from the log). Like uv, its python does not see X's own venv packages; and
      it ignores --system-site-packages: the test machine's site-packages are no node's.
  uv pip install --python PY [--index-url URL] [--excludes FILE] [-e DIR] [--no-deps] SPEC...
      fake packages into PY's venv: torch from PyTorch's ROCm or CPU index gets that index's
      local version (+rocm7.2, +cpu), and the ROCm one its torch.version.hip and triton-rocm;
      a bare name gets DEFAULTS' version.
      Like uv it sees only the venv's own site-packages, and skips excluded names (in -e DIR's
      pyproject.toml dependencies too) and names already there.
$STUB_UV_NO_EXCLUDES=1 makes it an uv too old for `pip install --excludes`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fakedist  # noqa: E402

DEFAULTS = {"triton": "3.9.0"}  # PyPI's latest triton: the CUDA build
TRITON_ROCM = "triton-rocm==3.7.1"  # what torch from PyTorch's ROCm index requires
ROCM = re.compile(r"\+rocm([\d.]+)$")


def main(argv: list[str]) -> int:
    installed: list[str] = []
    with open(os.environ["UV_STUB_LOG"], "a") as log:
        try:
            return run(argv, installed)
        finally:
            log.write(json.dumps({"argv": argv, "installed": installed}) + "\n")


def run(argv: list[str], installed: list[str]) -> int:
    if argv[:1] in (["--version"], ["-V"]):
        print("uv 0.10.0 (monarch-sky test stub)")
    elif argv[:3] == ["pip", "install", "--help"]:
        print("Usage: uv pip install [OPTIONS] ...")
        if os.environ.get("STUB_UV_NO_EXCLUDES") != "1":
            print("      --excludes <EXCLUDES>  Exclude packages from resolution")
    elif argv[:1] == ["venv"]:
        venv = Path(argv[-1])
        shutil.rmtree(venv, ignore_errors=True)
        fakedist.make_venv(venv)
    elif argv[:2] == ["pip", "install"]:
        pip_install(argv[2:], installed)
    else:
        print(f"uv stub: unexpected call {argv}", file=sys.stderr)
        return 2
    return 0


def pip_install(args: list[str], installed: list[str]) -> None:
    options, specs, editable = {}, [], None
    while args:
        arg = args.pop(0)
        if arg in ("--python", "-p", "--index-url", "--excludes", "-c"):
            options[arg] = args.pop(0)
        elif arg == "-e":
            editable = Path(args.pop(0))
        elif arg.startswith("-"):
            options[arg] = True
        else:
            specs.append(arg)
    site = fakedist.site_packages(Path(options.get("--python") or options["-p"]).parent.parent)
    excluded = set()
    if "--excludes" in options:
        excluded = {fakedist.normalize(n) for n in Path(options["--excludes"]).read_text().split()}
    if editable:
        (site / "__editable__.monarch_sky.pth").write_text(f"{editable}\n")
        fakedist.install(site, "monarch-sky", "0.1.0", package=False)
        if "--no-deps" not in options:
            specs += tomllib.loads((editable / "pyproject.toml").read_text())["project"]["dependencies"]
    for spec in specs:
        name, _, version = re.match(r"([A-Za-z0-9._-]+)\s*(==\s*([^;,\s]+))?", spec).groups()
        name = fakedist.normalize(name)
        there = fakedist.installed(site)
        if name in excluded or (name in there and version in (None, there[name].split("+")[0])):
            continue
        version = version or DEFAULTS.get(name, "1.0")
        index = re.search(r"/whl/(rocm[\d.]+|cpu)$", options.get("--index-url", ""))
        if name == "torch" and index:
            build = index.group(1)  # rocm7.2 or cpu
            version += "+" + build
            if build.startswith("rocm"):
                specs.append(TRITON_ROCM)  # the loop reaches it next
        rocm = ROCM.search(version) if name == "torch" else None
        fakedist.install(site, name, version, hip=rocm.group(1) if rocm else None)
        installed.append(f"{name}=={version}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
