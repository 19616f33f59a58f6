#!/usr/bin/env bash
# `make e2e-sky`: run recipes/debug.yaml through SkyPilot itself, on a one-node Slurm cluster
# stood up on this machine (root, Debian; offline but for the package registries).
#
# Slurm: slurmctld + slurmd on 127.0.0.1 with a fake GRES (gpu:mi300x:8, empty device files),
# reached by SkyPilot over ssh as user `sky` on 127.0.0.1:2222. SkyPilot's remote runtime setup
# downloads uv and a CPython 3.10 from the internet: both are pre-seeded where it looks for
# them (the cluster's home and runtime dir), uv from its PyPI wheel, the runtime venv from the
# system python. sky/setup.sh takes its wheel path on the system Python 3.11 with this machine's
# torch CPU wheel (TORCH_SPEC=/opt/wheels/...; a bare torch==2.13.0 from PyPI is a multi-GB CUDA
# build) and the rest from PyPI. Then `sky launch` runs sky/setup.sh and sky/bootstrap.sh like on a cloud:
# two replica groups on the node (REPLICAS_PER_NODE=2), one injected kill, healed from a peer.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SKY=${SKY:-$REPO/.venv-sky/bin/sky}
CLUSTER=${E2E_CLUSTER:-e2e}
SSH_PORT=${E2E_SSH_PORT:-2222}
HOST=$(hostname -s)
. "$REPO/tools/slurm_lib.sh"
say() { echo "[e2e-sky] $*"; }
die() { echo "[e2e-sky] $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (installs Slurm, munge and sshd, adds a user)"
[ -x "$SKY" ] || die "no SkyPilot at $SKY: run make .venv-sky/.installed"

say "installing slurm-wlm munge openssh-server rsync sudo"
if ! command -v slurmctld > /dev/null || ! command -v sshd > /dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge openssh-server rsync sudo > /dev/null
fi

say "user sky, reachable by ssh on 127.0.0.1:$SSH_PORT"
sky_user_sshd 127.0.0.1 "$SSH_PORT"
sky_environment

say "munge and a one-node Slurm cluster with gpu:mi300x:8"
munge_up
mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
chown -R slurm:slurm /var/lib/slurm /var/log/slurm 2> /dev/null || true
fake_gpus
MEM=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048))
{
  slurm_conf_head local "$HOST" 127.0.0.1
  cat << EOF
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$MEM Gres=gpu:mi300x:8 State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
} > /etc/slurm/slurm.conf
echo "NodeName=$HOST Name=gpu Type=mi300x File=/dev/fakegpu[0-7]" > /etc/slurm/gres.conf
pgrep slurmctld > /dev/null || slurmctld
pgrep slurmd > /dev/null || slurmd
sleep 2
scontrol update nodename="$HOST" state=resume 2> /dev/null || true
sinfo

say "SkyPilot: ~/.slurm/config and sky check"
sky_slurm_config localcluster 127.0.0.1 "$SSH_PORT"

say "taking down any earlier $CLUSTER cluster, then pre-seeding uv and SkyPilot's runtime venv"
"$SKY" down -y "$CLUSTER" > /dev/null 2>&1 || true
NAME=$CLUSTER-$(cat /root/.sky/user_hash)
seed_uv "/home/sky/.sky_clusters/$NAME"
sudo -u sky mkdir -p "/tmp/$NAME"
[ -d "/tmp/$NAME/skypilot-runtime" ] || sudo -u sky /usr/bin/python3 -m venv "/tmp/$NAME/skypilot-runtime"

TORCH_WHEEL=$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2> /dev/null | head -n 1)
[ -n "$TORCH_WHEEL" ] || die "no torch 2.13.0 CPU wheel in /opt/wheels (a PyPI torch is a multi-GB CUDA build)"
say "sky launch recipes/debug.yaml (2 replica groups on one node, a kill at step 20)"
cd "$REPO"
"$SKY" launch -y -c "$CLUSTER" recipes/debug.yaml --infra slurm/localcluster --num-nodes 1 \
  --cpus "$(nproc)" --memory 8 \
  --env REPLICAS_PER_NODE=2 --env PROCS_PER_REPLICA=2 --env TORCH_SPEC="$TORCH_WHEEL" --env TORCH_CPU_INDEX=https://pypi.org/simple --env MONARCH_SKY_PYTHON=3.11 \
  --env MONARCH_SKY_ARGS="steps=60 faults=kill@20:1 wandb.mode=disabled" \
  2>&1 | tee /tmp/e2e-sky.log
grep -q "Job finished (status: SUCCEEDED)" /tmp/e2e-sky.log || die "the SkyPilot job did not succeed (/tmp/e2e-sky.log)"
grep -q "recovered from" /tmp/e2e-sky.log || die "no run summary in the job output (/tmp/e2e-sky.log)"
grep -E " kill +1 +20 .* peer\s*$" /tmp/e2e-sky.log || die "the killed group did not heal from a peer"
say "passed: training on SkyPilot's Slurm cluster went through a kill; tearing down"
"$SKY" down -y "$CLUSTER"
