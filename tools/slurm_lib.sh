# The pieces of a SkyPilot-on-Slurm cluster stood up on this machine (root, Debian), shared by
# tools/e2e_sky.sh (one node on loopback) and tools/e2e_sky_nodes.sh (nodes in network
# namespaces). Source it after setting REPO and SKY; each function says what it takes.

fake_gpus() {  # the device files behind every node's fake gpu:mi300x:8 GRES
  local g
  for g in 0 1 2 3 4 5 6 7; do touch "/dev/fakegpu$g"; done
}

sky_user_sshd() {  # sky_user_sshd ADDR PORT [PIDFILE]: user `sky`, reachable by root's key over ssh at ADDR:PORT
  local addr=$1 port=$2 pidfile=${3:-}
  id sky > /dev/null 2>&1 || useradd -m -s /bin/bash sky
  mkdir -p /root/.ssh /home/sky/.ssh /run/sshd
  [ -f /root/.ssh/sky-slurm ] || ssh-keygen -q -t ed25519 -N '' -f /root/.ssh/sky-slurm
  cp /root/.ssh/sky-slurm.pub /home/sky/.ssh/authorized_keys
  chown -R sky:sky /home/sky/.ssh && chmod 700 /home/sky/.ssh && chmod 600 /home/sky/.ssh/authorized_keys
  ssh-keygen -A > /dev/null
  pgrep -f "sshd -o Port=$port -o ListenAddress=$addr" > /dev/null \
    || /usr/sbin/sshd -o Port="$port" -o ListenAddress="$addr" ${pidfile:+-o PidFile="$pidfile"}
}

munge_up() {  # munge with a key; sets MUNGE_STARTED=1 when this call started it
  MUNGE_STARTED=0
  [ -f /etc/munge/munge.key ] || mungekey --create 2> /dev/null || create-munge-key
  chown munge:munge /etc/munge/munge.key
  if ! pgrep -x munged > /dev/null; then service munge start > /dev/null && MUNGE_STARTED=1; fi
}

slurm_conf_head() {  # slurm_conf_head NAME CTLD_HOST CTLD_ADDR: slurm.conf's lines every cluster here has
  cat << CONF
ClusterName=$1
SlurmctldHost=$2($3)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
ReturnToService=2
CONF
}

sky_environment() {  # sky_environment [LINE...]: /etc/environment, what every shell and srun step of user sky sees
  # uv trusts the system CA store and never downloads a Python; then the caller's lines.
  {
    printf '%s\n' SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt UV_NATIVE_TLS=true UV_SYSTEM_CERTS=true \
      UV_PYTHON_DOWNLOADS=never SKYPILOT_DISABLE_USAGE_COLLECTION=1
    [ $# -eq 0 ] || printf '%s\n' "$@"
  } > /etc/environment
}

sky_slurm_config() {  # sky_slurm_config ALIAS ADDR PORT [SSH_OPTION...]: ~/.slurm/config's Host, then sky check
  local alias=$1 addr=$2 port=$3
  shift 3
  mkdir -p /root/.slurm
  {
    printf 'Host %s\n  HostName %s\n  Port %s\n  User sky\n  IdentityFile /root/.ssh/sky-slurm\n  IdentitiesOnly yes\n' \
      "$alias" "$addr" "$port"
    [ $# -eq 0 ] || printf '  %s\n' "$@"
  } > /root/.slurm/config
  export SKYPILOT_DISABLE_USAGE_COLLECTION=1
  "$SKY" check slurm
  "$SKY" show-gpus --infra slurm || true
}

seed_uv() {  # seed_uv CLUSTER_HOME: uv (from its PyPI wheel) where SkyPilot's runtime setup looks, so it downloads none
  local dir
  dir=$(mktemp -d)
  "$REPO/.venv/bin/python" -m pip download --quiet --no-deps --only-binary=:all: -d "$dir" uv
  unzip -qoj "$dir"/uv-*.whl '*/scripts/uv' -d "$dir"
  install -D -m 755 -o sky -g sky "$dir/uv" "$1/.local/bin/uv"
  rm -rf "$dir"
  chown -R sky:sky /home/sky/.sky_clusters
}
