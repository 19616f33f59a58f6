#!/usr/bin/env bash
# Node setup for monarch-sky on a SkyPilot cluster (each task's `setup` runs it).
#
# Leaves $MONARCH_SKY_VENV (default ~/monarch-sky-venv, whose python sky/bootstrap.sh runs) with
# monarch-sky on the stack it is tested with, or stops with a `monarch-sky setup: ...` line:
#   image path  python3 imports torch (a docker:rocm/pytorch image): a venv layered on the
#               image's Python, so its ROCm torch and triton are used and never replaced.
#   wheel path  no torch here (bare metal, Slurm, plain CPU nodes), or TORCH_SPEC is set: a fresh
#               venv on Python 3.12 (uv brings it) with PyTorch's own ROCm or CPU wheels.
# Knobs: TORCH_SPEC (a torch you name, e.g. a local wheel), TORCH_ROCM_INDEX, TORCH_CPU_INDEX,
# MONARCH_SKY_PYTHON (the wheel path's Python, default 3.12), UV (a uv binary).
set -euo pipefail

die() { echo "monarch-sky setup: $*" >&2; exit 1; }

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MONARCH_SKY_VENV:-$HOME/monarch-sky-venv}
PY=$VENV/bin/python
EXCLUDES=$VENV/monarch-sky-excludes.txt
# SkyPilot gives `setup` SKYPILOT_SETUP_NUM_GPUS_PER_NODE; SKYPILOT_NUM_GPUS_PER_NODE is `run`'s.
GPUS=${SKYPILOT_SETUP_NUM_GPUS_PER_NODE:-${SKYPILOT_NUM_GPUS_PER_NODE:-0}}
[[ $GPUS =~ ^[0-9]+$ ]] || die "GPUs per node '$GPUS' is not a number"
TORCH_VERSION=$(sed -n 's/^ *"torch==\([0-9.]*\)".*/\1/p' "$SRC/pyproject.toml")
[ -n "$TORCH_VERSION" ] || die "no torch==X.Y.Z pin in $SRC/pyproject.toml"
DEFAULT_ROCM_INDEX=https://download.pytorch.org/whl/rocm7.2
ROCM_INDEX=${TORCH_ROCM_INDEX:-$DEFAULT_ROCM_INDEX}
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
PYTHON_VERSION=${MONARCH_SKY_PYTHON:-3.12}
TRITON_ROCM=triton-rocm==3.7.1  # the triton torch 2.13.0+rocm7.2 is built for, on the same index
IMAGE_EXAMPLE=docker:rocm/pytorch:rocm10.0_ubuntu24.04_py3.12_pytorch_release_$TORCH_VERSION
# SkyPilot sets this for its own uv: clone/reflink mode can drop execute bits on XFS.
export UV_LINK_MODE=${UV_LINK_MODE:-copy}

find_uv() {
  if [ -n "${UV:-}" ]; then
    [ -x "$UV" ] || die "UV=$UV is not an executable"
  elif [ -x "$HOME/.local/bin/uv" ]; then
    UV=$HOME/.local/bin/uv  # SkyPilot installs it there on every node before `setup` runs
  elif command -v uv > /dev/null; then
    UV=$(command -v uv)
  else
    python3 -m pip install --quiet --user uv \
      || die "no uv here and pip could not install one: install uv (https://docs.astral.sh/uv/) or set UV"
    UV=$(python3 -m site --user-base)/bin/uv
  fi
  local help
  help=$("$UV" pip install --help) || die "$UV does not run"
  # uv ignores system site-packages, so it is told which packages to leave alone (write_excludes).
  [[ $help == *--excludes* ]] || die "$UV ($("$UV" --version)) has no 'uv pip install --excludes':" \
    "run '$UV self update' or set UV to a newer uv"
}

uv_install() { "$UV" pip install --python "$PY" "$@" || die "uv pip install $* failed (uv's error is above)"; }

image_has_torch() { [ -z "${TORCH_SPEC:-}" ] && python3 -c 'import torch' 2> /dev/null; }

make_image_venv() {
  local image_py site
  image_py=$(command -v python3)
  echo "monarch-sky setup: $image_py has torch: layering $VENV on it"
  "$UV" venv --clear --system-site-packages --python "$image_py" "$VENV" \
    || die "uv could not make a venv on $image_py"
  # uv builds the venv on the base interpreter under $image_py: when that python is itself a
  # venv (images that install torch into e.g. /opt/venv), its packages must be added back.
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  "$image_py" -c 'import sys, sysconfig
if sys.prefix != sys.base_prefix:
    for p in dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib")):
        print(f"import site; site.addsitedir({p!r})")' > "$site/_monarch_sky_image.pth"
}

make_wheel_venv() {
  echo "monarch-sky setup: installing Python $PYTHON_VERSION and PyTorch's wheels into $VENV"
  "$UV" venv --clear --python "$PYTHON_VERSION" "$VENV" || die "uv could not make a Python $PYTHON_VERSION venv"
  if [ "$GPUS" -eq 0 ]; then
    uv_install --index-url "$CPU_INDEX" "${TORCH_SPEC:-torch==$TORCH_VERSION}"
  elif [ -n "${TORCH_SPEC:-}" ]; then
    uv_install --index-url "$ROCM_INDEX" "$TORCH_SPEC"  # the torch you name brings its triton
  else
    uv_install --index-url "$ROCM_INDEX" "torch==$TORCH_VERSION" "$TRITON_ROCM"
  fi
}

# check_stack WHEN FIX: stop, naming FIX, unless $PY has the Python, torch and triton monarch-sky
# is tested with; WHEN=installed also imports the installed stack.
check_stack() {
  "$PY" - "$TORCH_VERSION" "$GPUS" "$@" << 'EOF'
import importlib
import importlib.metadata as md
import re
import sys

want, gpus, when, fix = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def stop(problem, fix=fix):
    sys.exit(f"monarch-sky setup: {problem}\n  fix: {fix}")


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


py = "%d.%d" % sys.version_info[:2]
if not (3, 11) <= sys.version_info[:2] <= (3, 13):
    stop(f"{sys.executable} is Python {py}; monarch-sky needs 3.11-3.13 (torchtitan 0.3.0 needs"
         " >=3.11; torchmonarch 0.7.0 and torchft 0.2.0 have wheels up to 3.13)")
try:
    import torch
except Exception as e:
    stop(f"{sys.executable} cannot import torch ({type(e).__name__}: {e})")
# torchmonarch declares no torch requirement (its extensions link libtorch), so no installer
# catches a different torch: this check is the guard.
release = re.match(r"\d+\.\d+\.\d+", torch.__version__)
if not release or release.group() != want:
    stop(f"torch {torch.__version__} ({torch.__file__}) is not torch {want}, the torch"
         " monarch-sky pins (pyproject.toml) and is tested with")

triton = version("triton")
rocm_triton = [f"{d} {version(d)}" for d in ("triton-rocm", "pytorch-triton-rocm") if version(d)]
if gpus:
    if not torch.version.hip:
        stop(f"torch {torch.__version__} is not a ROCm build (torch.version.hip is unset) on a node"
             f" with {gpus} GPUs")
    # PyPI's `triton` is the CUDA build, yet it ships an "amd" backend too, so triton.backends
    # cannot tell them apart; the distribution can. PyTorch's ROCm index calls its build
    # triton-rocm (pytorch-triton-rocm before); AMD's images build theirs as `triton` with a
    # local version (3.8.0+git...rocm10.0.0), which PyPI never hosts.
    if triton and "+" not in triton and rocm_triton:
        stop(f"PyPI's triton {triton} (a CUDA build) is installed over {rocm_triton[0]}: both"
             " write the `triton` package", fix=f"uninstall PyPI's triton (in"
             f" {md.distribution('triton').locate_file('')}) and reinstall {rocm_triton[0]}, or {fix}")
    if triton and "+" not in triton:
        stop(f"triton {triton} is PyPI's CUDA build; ROCm torch needs a ROCm triton (triton-rocm)")
    if not triton and not rocm_triton:
        stop("no triton is installed; ROCm torch needs its ROCm triton (triton-rocm)")

if when == "installed":
    for module in ("torchft", "torchtitan", "monarch", "monarch_sky"):
        try:
            importlib.import_module(module)
        except Exception as e:
            stop(f"{module} does not import ({type(e).__name__}: {e})",
                 fix="see uv's install log above; setup rebuilds the venv from scratch when rerun")
    print(f"monarch-sky setup: ready: {sys.executable} (Python {py}), torch {torch.__version__}"
          f" (hip {torch.version.hip}), triton {', '.join(rocm_triton) or triton}")
EOF
}

# torch and its triton are settled by now. uv must not resolve them again: it does not see an
# image's copies (it ignores system site-packages) and would put PyPI's builds over them.
write_excludes() {
  printf '%s\n' torch triton-rocm pytorch-triton-rocm > "$EXCLUDES"
  # pyproject.toml lists `triton` for CPU nodes (torchtitan imports it); where one is installed
  # (on GPU nodes always, check_stack saw to it) it stays: PyPI's is the CUDA build.
  if "$PY" -c 'import importlib.util, sys; sys.exit(not importlib.util.find_spec("triton"))'; then
    echo triton >> "$EXCLUDES"
  fi
}

# Nodes that share a home (Slurm's usual NFS home) run setup at the same time on the same venv:
# one builds it, the others wait for the lock and reuse it when it was built for what they ask.
mkdir -p "$(dirname "$VENV")"
exec 8> "$VENV.lock"
flock -w "${MONARCH_SKY_SETUP_WAIT_S:-3600}" 8 || die "another node's setup of $VENV did not finish (lock $VENV.lock)"
READY=$VENV/.monarch-sky-ready
WANT=$(printf '%s|' "$(sha256sum "$SRC/pyproject.toml" | cut -c1-16)" "$GPUS" "${TORCH_SPEC:-}" \
  "$ROCM_INDEX" "$CPU_INDEX" "$PYTHON_VERSION" "$(command -v python3)")
# A real model's tokenizer (its recipe's data.tokenizer_repo) comes from the hub with the HF_TOKEN
# secret, before training: a missing or wrong token stops here, with the fix.
fetch_tokenizer() {
  [ -n "${RECIPE:-}" ] || return 0
  "$PY" -m monarch_sky fetch-tokenizer --recipe "$RECIPE" || die "could not fetch the tokenizer of recipe $RECIPE (why: above)"
  fetch_weights
}
# Released weights the run starts from (init.weights_repo=... in MONARCH_SKY_ARGS), to every node's
# disk: each group loads them from its own node at start. A run from scratch fetches nothing.
fetch_weights() {
  local quoted
  quoted=$("$PY" -c 'import os, shlex
print(" ".join(shlex.quote(w) for w in shlex.split(os.environ.get("MONARCH_SKY_ARGS", "")) if w.startswith("init.")))') \
    || die "MONARCH_SKY_ARGS='${MONARCH_SKY_ARGS:-}' does not split into words (an unclosed quote?)"
  local -a init
  eval "init=($quoted)"  # every word shlex-quoted above
  [ ${#init[@]} -gt 0 ] || return 0
  "$PY" -m monarch_sky fetch-weights recipe="$RECIPE" "${init[@]}" || die "could not fetch the weights the run starts from (why: above)"
}

if [ -f "$READY" ] && [ "$(cat "$READY")" = "$WANT" ] && "$PY" -c 'import monarch_sky' 2> /dev/null; then
  echo "monarch-sky setup: $VENV is ready (set up with the same settings, e.g. by a node sharing this home)"
  fetch_tokenizer
  exit 0
fi
rm -f "$READY"

find_uv
if image_has_torch; then
  FIX="use an image with Python 3.11-3.13 and torch $TORCH_VERSION for ROCm (e.g. $IMAGE_EXAMPLE),"
  FIX+=" or set TORCH_SPEC=torch==$TORCH_VERSION to install PyTorch's wheels into a Python 3.12 venv"
  make_image_venv
else
  FIX="set TORCH_SPEC to torch==$TORCH_VERSION (or unset it), and TORCH_ROCM_INDEX to a PyTorch"
  FIX+=" index with torch $TORCH_VERSION for ROCm (default $DEFAULT_ROCM_INDEX)"
  make_wheel_venv
fi
check_stack settled "$FIX"
write_excludes
uv_install --excludes "$EXCLUDES" -e "$SRC"  # pyproject.toml lists the rest
check_stack installed "$FIX"
echo "$WANT" > "$READY"
fetch_tokenizer
