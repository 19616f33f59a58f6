#!/usr/bin/env bash
# Node bootstrap for monarch-sky on SkyPilot (each task's `run` calls it).
#
# MONARCH_SKY_ROLE picks what this node does:
#   cluster (default)  `sky launch recipes/llama.yaml`: every node checks itself
#                      (`monarch-sky doctor`) and starts one Monarch worker loop per replica
#                      group it hosts; node rank 0 also runs the controller (which starts the
#                      TorchFT lighthouse) against every node's workers.
#   worker             workers only: a replica-group task of a job group (recipes/llama-spot.yaml),
#                      reachable as <WORKER_TASK>-0.<job group>, or a replacement cluster the
#                      controller launched (HOST_REPLACEMENT=skypilot), reachable by its IP.
#   controller         the job group's controller task: attaches to the GROUP_TASKS' workers.
# When training ends the controller shuts every worker down and each node's run exits.
# Safe to run again on a node: a live worker is reused, not doubled.
#
# Reads SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE
# (and SKYPILOT_JOBGROUP_NAME in job groups) and the task envs: RECIPE, REPLICAS_PER_NODE,
# PROCS_PER_REPLICA (CPU nodes), WORKER_PORT, MONARCH_SKY_ARGS (extra `monarch-sky train`
# overrides), MONARCH_SKY_PY (the python with monarch_sky installed).
set -euo pipefail

die() { echo "monarch-sky bootstrap: $*" >&2; exit 1; }
need() { [ -n "${!1:-}" ] || die "$1 is not set: run this from a SkyPilot task (or set it as SkyPilot would)"; }

ROLE=${MONARCH_SKY_ROLE:-cluster}
case "$ROLE" in cluster | worker | controller) ;; *) die "MONARCH_SKY_ROLE=$ROLE is not cluster, worker or controller" ;; esac
need SKYPILOT_NODE_RANK
need SKYPILOT_NODE_IPS
need SKYPILOT_NUM_NODES
RANK=$SKYPILOT_NODE_RANK
NODES=$SKYPILOT_NUM_NODES
GPUS=${SKYPILOT_NUM_GPUS_PER_NODE:-0}
PER_NODE=${REPLICAS_PER_NODE:-1}
PORT=${WORKER_PORT:-26600}
RECIPE=${RECIPE:-llama3_8b}
if [ -z "${MONARCH_SKY_PY:-}" ] && [ -x "$HOME/monarch-sky-venv/bin/python" ]; then
  MONARCH_SKY_PY=$HOME/monarch-sky-venv/bin/python
fi
PY=${MONARCH_SKY_PY:-python3}
STATE=${MONARCH_SKY_STATE:-/tmp/monarch-sky}
mkdir -p "$STATE"

mapfile -t IPS < <(printf '%s\n' "$SKYPILOT_NODE_IPS" | sed '/^[[:space:]]*$/d')
[ "${#IPS[@]}" -eq "$NODES" ] || die "SKYPILOT_NODE_IPS lists ${#IPS[@]} addresses but SKYPILOT_NUM_NODES=$NODES"
if [ "$RANK" -lt 0 ] || [ "$RANK" -ge "$NODES" ]; then
  die "SKYPILOT_NODE_RANK=$RANK is not in 0..$((NODES - 1))"
fi
MY_IP=${IPS[$RANK]}
"$PY" -c 'import monarch_sky' 2>/dev/null || die "$PY cannot import monarch_sky: did sky/setup.sh run? (or set MONARCH_SKY_PY)"
[ $((PER_NODE)) -ge 1 ] || die "REPLICAS_PER_NODE=$PER_NODE must be >= 1"
if [ "$GPUS" -gt 0 ]; then
  [ $((GPUS % PER_NODE)) -eq 0 ] || die "REPLICAS_PER_NODE=$PER_NODE does not divide the node's $GPUS GPUs"
  PROCS=$((GPUS / PER_NODE))
else
  PROCS=${PROCS_PER_REPLICA:-1}
fi

# --- network and ROCm environment -------------------------------------------------
IFACE=$(ip -o -4 addr show 2>/dev/null | awk -v ip="$MY_IP" '{split($4, a, "/"); if (a[1] == ip) print $2}' | head -n 1 || true)
if [ -n "$IFACE" ]; then
  export NCCL_SOCKET_IFNAME=$IFACE GLOO_SOCKET_IFNAME=$IFACE  # RCCL reads the NCCL_* names
else
  echo "monarch-sky bootstrap: no interface found for $MY_IP; RCCL and gloo pick one themselves" >&2
fi
if ! ls /sys/class/infiniband/* > /dev/null 2>&1; then
  export NCCL_IB_DISABLE=1  # no RDMA devices: sockets only
fi
export HSA_NO_SCRATCH_RECLAIM=1
# Trainer output goes to each node's worker log lines below, which SkyPilot streams for every
# node. (Monarch's own log forwarding made stopping a mesh with a dead process hang.)

EXPECT=()  # a GPU node must see its GPUs
[ "$GPUS" -gt 0 ] && EXPECT=(--expect-gpus "$GPUS")

doctor() {  # doctor LABEL ARGS...: run `monarch-sky doctor`, prefix its lines, keep its status
  local label=$1
  shift
  "$PY" -m monarch_sky doctor "$@" 2>&1 | sed -u "s/^/[$label doctor] /"
  return "${PIPESTATUS[0]}"
}

WORKER_PIDS=()
start_workers() {  # start_workers ADVERTISED_HOST: one worker per replica group on this node
  local advertise=$1 g port pidfile address
  for ((g = 0; g < PER_NODE; g++)); do
    port=$((PORT + g))
    pidfile=$STATE/worker-$port.pid
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2> /dev/null; then
      echo "monarch-sky bootstrap: node $RANK worker on port $port already running (pid $(cat "$pidfile"))"
      WORKER_PIDS+=("$(cat "$pidfile")")
      continue
    fi
    address=tcp://$advertise:$port
    [ "$advertise" = "$MY_IP" ] || address="$address@tcp://0.0.0.0:$port"  # advertise a name
    if [ "$GPUS" -gt 0 ]; then
      HIP_VISIBLE_DEVICES=$(seq -s, $((g * PROCS)) $(((g + 1) * PROCS - 1))) \
        "$PY" -m monarch_sky worker --address "$address" --until-shutdown \
        > >(sed -u "s/^/[node $RANK worker $g] /") 2>&1 &
    else
      "$PY" -m monarch_sky worker --address "$address" --until-shutdown \
        > >(sed -u "s/^/[node $RANK worker $g] /") 2>&1 &
    fi
    echo $! > "$pidfile"
    WORKER_PIDS+=("$!")
  done
  local mine=()
  for ((g = 0; g < PER_NODE; g++)); do mine+=("$MY_IP:$((PORT + g))"); done
  "$PY" -m monarch_sky doctor --workers "$(IFS=,; echo "${mine[*]}")" --wait 60 > /dev/null \
    || die "node $RANK: a worker did not start listening (see the [node $RANK worker] lines)"
}

wait_workers() {
  local pid
  for pid in "${WORKER_PIDS[@]}"; do wait "$pid" 2> /dev/null || true; done
}

train() {  # train ADDRESSES(comma-separated) REPLICAS EXTRA_OVERRIDES...
  local all=$1 replicas=$2
  shift 2
  doctor "controller" --workers "$all" --wait "${WORKER_WAIT_S:-600}" \
    || die "not every worker answers (see the FAIL lines above)"
  # SKYPILOT_TASK_ID survives managed-job recoveries: a new controller of the same run
  # reaps what the old one left and reports the steps that were lost.
  local run_id
  run_id=$(printf '%s' "${SKYPILOT_TASK_ID:-}" | tr -c 'A-Za-z0-9_.-' '-')
  # shellcheck disable=SC2086  # MONARCH_SKY_ARGS is a list of KEY=VALUE words
  "$PY" -m monarch_sky train recipe="$RECIPE" replicas="$replicas" procs_per_replica="$PROCS" \
    hosts.provider=addresses "hosts.addresses=[$all]" hosts.controller_ip="$MY_IP" \
    ${run_id:+run_id=$run_id} "$@" ${MONARCH_SKY_ARGS:-}  # later overrides win
}

case "$ROLE" in
  worker)
    NAME="node $RANK" ADVERTISE=$MY_IP
    if [ -n "${WORKER_TASK:-}" ] && [ -n "${SKYPILOT_JOBGROUP_NAME:-}" ]; then
      NAME=$WORKER_TASK ADVERTISE=$WORKER_TASK-0.$SKYPILOT_JOBGROUP_NAME
    fi
    doctor "$NAME" "${EXPECT[@]}" || die "preflight failed on $NAME ($MY_IP)"
    start_workers "$ADVERTISE"
    echo "monarch-sky bootstrap: $NAME serving until the controller finishes"
    wait_workers
    ;;
  controller)
    need GROUP_TASKS
    need SKYPILOT_JOBGROUP_NAME
    doctor "controller" || die "preflight failed on the controller ($MY_IP)"
    PROCS=${GPUS_PER_GROUP:-$PROCS}
    ADDRS=()
    for task in $GROUP_TASKS; do ADDRS+=("$task-0.$SKYPILOT_JOBGROUP_NAME:$PORT"); done
    train "$(IFS=,; echo "${ADDRS[*]}")" "${#ADDRS[@]}" \
      hosts.provision_timeout_s="${REPLACEMENT_WAIT_S:-1800}"
    ;;
  cluster)
    doctor "node $RANK" "${EXPECT[@]}" || die "preflight failed on node $RANK ($MY_IP)"
    start_workers "$MY_IP"
    if [ "$RANK" -ne 0 ]; then
      echo "monarch-sky bootstrap: node $RANK serving until the controller on ${IPS[0]} finishes"
      wait_workers
      exit 0
    fi
    ADDRS=()
    for ip in "${IPS[@]}"; do
      for ((g = 0; g < PER_NODE; g++)); do ADDRS+=("$ip:$((PORT + g))"); done
    done
    REPLACE=()
    if [ "${HOST_REPLACEMENT:-none}" = "skypilot" ]; then  # needs `sky` and credentials here
      need RECIPE_YAML
      REPLACE=(hosts.provider=skypilot hosts.recipe_yaml="$RECIPE_YAML")
    fi
    set +e
    train "$(IFS=,; echo "${ADDRS[*]}")" $((NODES * PER_NODE)) "${REPLACE[@]}"
    RC=$?
    set -e
    wait_workers
    exit $RC
    ;;
esac
