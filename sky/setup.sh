#!/usr/bin/env bash
# Node setup for monarch-sky on a SkyPilot cluster (each task's `setup` runs it).
# Installs monarch-sky and its pinned dependencies into a venv that sees the image's
# ROCm torch, and never replaces that torch with a CUDA or CPU build.
set -euo pipefail

die() { echo "monarch-sky setup: $*" >&2; exit 1; }

VENV=${MONARCH_SKY_VENV:-$HOME/monarch-sky-venv}
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

python3 -m venv --system-site-packages "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"

if [ -n "${TORCH_SPEC:-}" ]; then
  python -m pip install --quiet "$TORCH_SPEC"  # a torch you name (e.g. torch==2.13.0 from a local wheel)
elif ! python -c 'import torch' 2>/dev/null; then
  # Images without torch (OCI bare metal, plain CPU nodes): PyTorch's own ROCm or CPU build.
  if [ "${SKYPILOT_NUM_GPUS_PER_NODE:-0}" != "0" ]; then
    INDEX=${TORCH_ROCM_INDEX:-https://download.pytorch.org/whl/rocm6.4}
  else
    INDEX=https://download.pytorch.org/whl/cpu
  fi
  python -m pip install --quiet torch --index-url "$INDEX"
fi
TORCH=$(python -c 'import torch; print(torch.__version__)')
HIP=$(python -c 'import torch; print(torch.version.hip or "")')
if [ "${SKYPILOT_NUM_GPUS_PER_NODE:-0}" != "0" ] && [ -z "$HIP" ]; then
  die "torch $TORCH here is not a ROCm build; use a ROCm image (rocm/pytorch) or set TORCH_ROCM_INDEX"
fi

# Pin torch to what is installed, so no dependency can pull another build.
echo "torch==$TORCH" > "$VENV/torch-constraint.txt"
python -m pip install --quiet -c "$VENV/torch-constraint.txt" \
  torchft==0.2.0 torchtitan==0.3.0 torchmonarch==0.7.0 triton omegaconf wandb psutil
python -m pip install --quiet --no-deps -e "$SRC"
python -c "import torch, monarch_sky; print('monarch-sky setup: torch', torch.__version__, 'hip', torch.version.hip)"
