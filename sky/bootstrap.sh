#!/usr/bin/env bash
# Node bootstrap for monarch-sky on SkyPilot (each task's `run` calls it).
#
# MONARCH_SKY_ROLE picks what this node does:
#   cluster (default)  `sky launch recipes/llama.yaml`: every node checks itself
#                      (`monarch-sky doctor`) and starts one Monarch worker loop per replica
#                      group it hosts; node rank 0 also runs the controller (which starts the
#                      TorchFT lighthouse) against every node's workers. Every other node runs a
#                      standby (`monarch-sky standby`) that watches the controller doors
#                      (CONTROLLER_PORT) of the nodes before it and, when none has answered for
#                      TAKEOVER_AFTER_S (10), takes the run over from node memory (docs/cloud.md).
#   worker             workers only: a replica-group task of a job group (recipes/llama-group.yaml),
#                      reachable as <WORKER_TASK>-0.<job group>, or a replacement cluster the
#                      controller launched (HOST_REPLACEMENT=skypilot), reachable by its IP.
#   controller         the job group's controller task: attaches to the GROUP_TASKS' workers.
# When training ends the controller shuts every worker down and each node's run exits.
# Safe to run again on a node: a live worker is reused, not doubled, and a second controller
# (node rank 0 or the controller role, e.g. `sky exec` on a live cluster) refuses to start.
#
# Exit codes (SkyPilot marks the task FAILED on any non-zero, so managed jobs' recovery fires):
#   0    every worker here ended because the controller shut it down (`--until-shutdown`);
#        on node rank 0 and in the controller role, training succeeded
#   75   (EX_TEMPFAIL) this host must be replaced: the node's own preflight (`monarch-sky
#        doctor`: the GPUs torch sees, RCCL/gloo in the torch build) failed, in the cluster and
#        worker roles. Job-group recipes set `recover_on_exit_codes: [75]` so a bad host is
#        replaced without spending `max_restarts_on_errors`. Nothing else exits 75.
#   N    a worker here died on its own: its exit status (137: SIGKILL, e.g. the OOM killer;
#        a worker's own 75 becomes 1, since 75 is this script's verdict on the host), in the
#        worker role; a cluster-role node of rank > 0 exits 0 then, saying so, since one node's
#        non-zero run makes SkyPilot cancel every node's (the controller absorbs the loss)
#   1-5  on node rank 0 and in the controller role: `monarch-sky train`'s code (its workers'
#        deaths are already in that verdict; 5: another node's controller took the run over);
#        on a node whose standby took the run over, the same code of its controller; anywhere:
#        1 when this script stops itself (bad settings, a controller already running on the
#        node, a worker that never listened)
#
# Reads SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE
# (and SKYPILOT_JOBGROUP_NAME in job groups) and the task envs: RECIPE, REPLICAS_PER_NODE,
# HOSTS_PER_REPLICA (nodes one replica group spans; consecutive node ranks form a group),
# SPARE_NODES (cluster role: the last nodes are hot spares, `hosts.spares`),
# PROCS_PER_REPLICA (CPU nodes), WORKER_PORT, CONTROLLER_PORT (default WORKER_PORT - 1),
# TAKEOVER_AFTER_S, RUN_DIR (where the run record goes), MONARCH_SKY_ARGS
# (extra `monarch-sky train` overrides), MONARCH_SKY_PY (the python with monarch_sky installed); for tests,
# MONARCH_SKY_STATE (pid, rc and lock files), MONARCH_SKY_SYSFS and MONARCH_SKY_DEV (roots
# the RDMA probe reads instead of /sys and /dev).
set -euo pipefail

EX_REPLACE_HOST=75
die() { echo "monarch-sky bootstrap: $*" >&2; exit 1; }
say() { echo "monarch-sky bootstrap: $*"; }
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
PER_GROUP=${HOSTS_PER_REPLICA:-1}
PORT=${WORKER_PORT:-26600}
DOOR=${CONTROLLER_PORT:-$((PORT - 1))}  # answers while this node's controller lives; the other nodes' standbys watch it
RECIPE=${RECIPE:-llama3_8b}
if [ -z "${MONARCH_SKY_PY:-}" ] && [ -x "$HOME/monarch-sky-venv/bin/python" ]; then
  MONARCH_SKY_PY=$HOME/monarch-sky-venv/bin/python
fi
PY=${MONARCH_SKY_PY:-python3}
# Per user and private: on a shared node another user must not plant files (or a link) here.
STATE=${MONARCH_SKY_STATE:-/tmp/monarch-sky-$(id -u)}
mkdir -p -m 700 "$STATE"
{ [ -O "$STATE" ] && [ ! -L "$STATE" ]; } || die "$STATE belongs to another user or is a link; set MONARCH_SKY_STATE"
chmod 700 "$STATE"

mapfile -t IPS < <(printf '%s\n' "$SKYPILOT_NODE_IPS" | sed '/^[[:space:]]*$/d')
[ "${#IPS[@]}" -eq "$NODES" ] || die "SKYPILOT_NODE_IPS lists ${#IPS[@]} addresses but SKYPILOT_NUM_NODES=$NODES"
if [ "$RANK" -lt 0 ] || [ "$RANK" -ge "$NODES" ]; then
  die "SKYPILOT_NODE_RANK=$RANK is not in 0..$((NODES - 1))"
fi
MY_IP=${IPS[$RANK]}

# One controller per node: the lock lives as long as this shell and `monarch-sky train` (workers
# are started without it). It names the holder's pid for the message of the next one.
if [ "$ROLE" = controller ] || { [ "$ROLE" = cluster ] && [ "$RANK" -eq 0 ]; }; then
  command -v flock > /dev/null || die "flock (util-linux) is missing: it guards against a second controller"
  LOCK=$STATE/controller.lock
  exec 9>> "$LOCK"
  flock -n 9 || die "a controller already runs on this node (bootstrap pid $(cat "$LOCK" 2> /dev/null || echo '?'), lock $LOCK): not starting a second one; wait for it or stop it first"
  echo $$ > "$LOCK"
fi
"$PY" -c 'import monarch_sky' 2>/dev/null || die "$PY cannot import monarch_sky: did sky/setup.sh run? (or set MONARCH_SKY_PY)"
[ $((PER_NODE)) -ge 1 ] || die "REPLICAS_PER_NODE=$PER_NODE must be >= 1"
[ $((PER_GROUP)) -ge 1 ] || die "HOSTS_PER_REPLICA=$PER_GROUP must be >= 1"
if [ "$PER_GROUP" -gt 1 ]; then
  [ "$PER_NODE" -eq 1 ] || die "HOSTS_PER_REPLICA=$PER_GROUP needs REPLICAS_PER_NODE=1: a group spanning nodes uses all their GPUs"
  [ "$ROLE" != controller ] || die "HOSTS_PER_REPLICA=$PER_GROUP: a job group's replica tasks are one node each; use the cluster recipes"
fi
SPARES=${SPARE_NODES:-0}  # cluster role: the last SPARE_NODES nodes wait, warm, for a lost node's group
[[ "$SPARES" =~ ^[0-9]+$ ]] || die "SPARE_NODES=$SPARES must be a whole number"
if [ "$ROLE" = cluster ]; then
  [ "$SPARES" -lt "$NODES" ] || die "SPARE_NODES=$SPARES leaves none of the $NODES nodes to train: launch more (--num-nodes) or lower it"
  [ $(((NODES - SPARES) % PER_GROUP)) -eq 0 ] || die "HOSTS_PER_REPLICA=$PER_GROUP does not divide the $((NODES - SPARES)) nodes left after SPARE_NODES=$SPARES: launch a multiple of it plus the spares (--num-nodes)"
fi
if [ "$GPUS" -gt 0 ]; then
  [ $((GPUS % PER_NODE)) -eq 0 ] || die "REPLICAS_PER_NODE=$PER_NODE does not divide the node's $GPUS GPUs"
  PROCS=$((GPUS / PER_NODE))
else
  PROCS=${PROCS_PER_REPLICA:-1}
fi

# --- network and ROCm environment -------------------------------------------------
# RDMA only where this container can open it, sockets on this node's interface otherwise; a
# preset NCCL_*/GLOO_* wins (monarch_sky/hosts/doctor.py `rccl_env`, reported by the doctor below).
ENV_SH=$("$PY" -m monarch_sky.hosts.doctor --print-env "$MY_IP") || die "could not work out the RCCL/gloo environment"
eval "$ENV_SH"

# Mutual TLS (monarch_sky/hosts/tls.py): with the run's CA in MONARCH_SKY_TLS_CA/_KEY (secrets), only
# processes holding a certificate from it can attach to a worker here or reach the controller.
SCHEME=tcp
if [ -n "${MONARCH_SKY_TLS_CA:-}" ]; then
  TLS_NAMES=("$MY_IP")  # every name this node is dialled by
  if [ -n "${WORKER_TASK:-}" ] && [ -n "${SKYPILOT_JOBGROUP_NAME:-}" ]; then
    TLS_NAMES+=("$WORKER_TASK-0.$SKYPILOT_JOBGROUP_NAME")
  fi
  TLS_SH=$("$PY" -m monarch_sky tls-node --out "$STATE/tls" "${TLS_NAMES[@]}") \
    || die "could not issue this node's TLS certificate from MONARCH_SKY_TLS_CA/_KEY (see above)"
  eval "$TLS_SH"
  SCHEME=tls
else
  say "no MONARCH_SKY_TLS_CA: anything that reaches a worker port here can run code (docs/security.md)" >&2
fi
# Trainer output goes to each node's worker log lines below, which SkyPilot streams for every
# node. (Monarch's own log forwarding made stopping a mesh with a dead process hang.)

EXPECT=()  # a GPU node must see its GPUs
[ "$GPUS" -gt 0 ] && EXPECT=(--expect-gpus "$GPUS")

preflight_failed() {  # preflight_failed NAME: this host cannot serve; ask for another one
  echo "monarch-sky bootstrap: preflight failed on $1 ($MY_IP): this host must be replaced (exit $EX_REPLACE_HOST)" >&2
  exit "$EX_REPLACE_HOST"
}

doctor() {  # doctor LABEL ARGS...: run `monarch-sky doctor`, prefix its lines, keep its status
  local label=$1
  shift
  "$PY" -m monarch_sky doctor "$@" 2>&1 | sed -u "s/^/[$label doctor] /"
  return "${PIPESTATUS[0]}"
}

# A worker runs in a subshell that records its exit status in $STATE/worker-PORT.rc; its own
# pid is in worker-PORT.pid, so a later bootstrap on this node can find it and adopt it.
WAITERS=()  # subshells of the workers this bootstrap started: `wait` gives their status
ADOPTED=()  # pids of live workers an earlier bootstrap started: polled, then their rc file
STARTED=()  # ports of the workers this bootstrap started

worker_on_port() {  # worker_on_port PID PORT: is PID a live `monarch_sky worker` on PORT?
  local pid=$1 port=$2 args=() i
  [[ "$pid" =~ ^[0-9]+$ ]] && alive "$pid" || return 1
  mapfile -d '' -t args 2> /dev/null < "/proc/$pid/cmdline" || return 1
  for ((i = 0; i + 3 < ${#args[@]}; i++)); do
    if [ "${args[i]}" = -m ] && [ "${args[i + 1]}" = monarch_sky ] && [ "${args[i + 2]}" = worker ]; then
      [[ " ${args[*]:i+3} " =~ [:]$port[@[:space:]] ]] && return 0
    fi
  done
  return 1
}

alive() {  # alive PID: running, not a zombie
  local stat
  kill -0 "$1" 2> /dev/null && stat=$(cat "/proc/$1/stat" 2> /dev/null) || return 1
  stat=${stat##*) }
  [ "${stat:0:1}" != Z ]
}

# Monarch 0.7.0 never attaches a controller to a new worker at the address of one that died
# under it, so a worker started again (after a crash, or on a node that came back with its
# $STATE) listens COMEBACK_PORT_STEP above the last one; the controller looks for it there
# (monarch_sky/hosts/addresses.py, the same step). State files are named by the slot's first port.
COMEBACK_PORT_STEP=100
WORKER_RESTARTS=${WORKER_RESTARTS:-3}  # a worker that dies on its own is started again this often

serve_worker() {  # serve_worker G BASE PORT ADVERTISED: run slot G's worker, again if it dies
  local g=$1 base=$2 port=$3 advertise=$4 restarts=0 rc address
  while true; do
    echo "$port" > "$STATE/worker-$base.port"
    address=$SCHEME://$advertise:$port
    # A name is advertised and all interfaces bound (TCP only; a tls:// name binds its own IP).
    [ "$advertise" = "$MY_IP" ] || [ "$SCHEME" = tls ] || address="$address@tcp://0.0.0.0:$port"
    "$PY" -m monarch_sky worker --address "$address" --until-shutdown \
      > >(sed -u "s/^/[node $RANK worker $g] /") 2>&1 &
    echo $! > "$STATE/worker-$base.pid"
    rc=0
    wait $! || rc=$?
    { [ "$rc" -ne 0 ] && [ "$restarts" -lt "$WORKER_RESTARTS" ]; } || break
    restarts=$((restarts + 1)) port=$((port + COMEBACK_PORT_STEP))
    say "node $RANK worker on port $((port - COMEBACK_PORT_STEP)) exited with status $rc: starting it again on port $port ($restarts/$WORKER_RESTARTS)" >&2
  done
  echo "$rc" > "$STATE/worker-$base.rc"
  return "$rc"
}

start_workers() {  # start_workers ADVERTISED_HOST: one worker per replica group on this node
  local advertise=$1 g base port pidfile pid mine=()
  for ((g = 0; g < PER_NODE; g++)); do
    base=$((PORT + g))
    pidfile=$STATE/worker-$base.pid
    pid=$(cat "$pidfile" 2> /dev/null || true)
    port=$(cat "$STATE/worker-$base.port" 2> /dev/null || echo "$base")
    if [ -n "$pid" ] && worker_on_port "$pid" "$port"; then
      say "node $RANK worker on port $port already running (pid $pid): waiting for it"
      ADOPTED+=("$base:$pid")
      mine+=("$MY_IP:$port")
      continue
    fi
    [ -z "$pid" ] || say "node $RANK: $pidfile names pid $pid, which is no worker on port $port: starting one"
    # A worker of this run served here before: its address cannot be attached to again.
    [ ! -f "$STATE/worker-$base.port" ] || port=$((port + COMEBACK_PORT_STEP))
    rm -f "$pidfile" "$STATE/worker-$base.rc"
    (
      exec 9>&-  # the controller lock stays with the controller
      # The CA key signs node certificates: the controller keeps it (for replacement nodes); a
      # worker, its log pipe and the trainers it starts never hold it.
      unset MONARCH_SKY_TLS_CA_KEY
      if [ "$GPUS" -gt 0 ]; then
        export HIP_VISIBLE_DEVICES=$(seq -s, $((g * PROCS)) $(((g + 1) * PROCS - 1)))
      fi
      serve_worker "$g" "$base" "$port" "$advertise"
    ) &
    WAITERS+=("$base:$!")
    STARTED+=("$base")
    mine+=("$MY_IP:$port")
  done
  if ! "$PY" -m monarch_sky doctor --workers "$(IFS=,; echo "${mine[*]}")" --wait 60 > /dev/null; then
    for base in "${STARTED[@]}"; do kill "$(cat "$STATE/worker-$base.pid" 2> /dev/null)" 2> /dev/null || true; done
    die "node $RANK: a worker did not start listening (see the [node $RANK worker] lines)"
  fi
}

wait_workers() {  # wait for every worker here; 0 only if each ended by the controller's shutdown
  local entry port pid rc worst=0
  for entry in ${WAITERS[@]+"${WAITERS[@]}"}; do
    port=${entry%%:*} pid=${entry#*:} rc=0
    wait "$pid" || rc=$?
    [ "$rc" -eq 0 ] || say "node $RANK worker on port $port exited with status $rc" >&2
    [ "$worst" -ne 0 ] || worst=$rc
  done
  for entry in ${ADOPTED[@]+"${ADOPTED[@]}"}; do
    port=${entry%%:*} pid=${entry#*:}
    # Its bootstrap may start it again (a new pid in the pidfile); the rc file is the end.
    local now=$pid
    while [ ! -s "$STATE/worker-$port.rc" ]; do
      alive "$now" || { sleep 5; now=$(cat "$STATE/worker-$port.pid" 2> /dev/null || true); alive "$now" || break; }
      sleep 2
    done
    for _ in 1 2 3 4 5; do [ -s "$STATE/worker-$port.rc" ] && break; sleep 1; done  # its subshell writes it
    rc=$(cat "$STATE/worker-$port.rc" 2> /dev/null || echo 1)  # no rc file: whoever waited for it died too
    [[ "$rc" =~ ^[0-9]+$ ]] || rc=1
    [ "$rc" -eq 0 ] || say "node $RANK worker on port $port (pid $pid, adopted) exited with status $rc" >&2
    [ "$worst" -ne 0 ] || worst=$rc
  done
  [ "$worst" -ne "$EX_REPLACE_HOST" ] || worst=1  # 75 is this script's verdict, not a worker's
  return "$worst"
}

train_args() {  # train_args ADDRESSES(comma-separated) REPLICAS EXTRA_OVERRIDES...: the `monarch-sky train` words, in TRAIN
  local all=$1 replicas=$2
  shift 2
  # SKYPILOT_TASK_ID survives managed-job recoveries: a new controller of the same run
  # reaps what the old one left and reports the steps that were lost.
  local run_id
  run_id=$(printf '%s' "${SKYPILOT_TASK_ID:-}" | tr -c 'A-Za-z0-9_.-' '-')
  # MONARCH_SKY_ARGS: KEY=VALUE words split as a shell splits them (quotes hold a value with
  # spaces), with nothing expanded: `chaos.kinds=[kill,host]` is no glob.
  local quoted
  quoted=$("$PY" -c 'import os, shlex; print(" ".join(map(shlex.quote, shlex.split(os.environ.get("MONARCH_SKY_ARGS", "")))))') \
    || die "MONARCH_SKY_ARGS='${MONARCH_SKY_ARGS:-}' does not split into words (an unclosed quote?)"
  local -a extra
  eval "extra=($quoted)"  # every word shlex-quoted above
  TRAIN=(train recipe="$RECIPE" replicas="$replicas" procs_per_replica="$PROCS" hosts_per_replica="$PER_GROUP"
    hosts.provider=addresses "hosts.addresses=[$all]" hosts.controller_ip="$MY_IP" hosts.controller_port="$DOOR"
    ${run_id:+run_id=$run_id} ${RUN_DIR:+run_dir=$RUN_DIR} "$@" "${extra[@]}")  # later overrides win
}

train() {  # train ADDRESSES(comma-separated) REPLICAS EXTRA_OVERRIDES...: once every worker answers, the controller here
  doctor "controller" --workers "$1" --wait "${WORKER_WAIT_S:-600}" \
    || die "not every worker answers (see the FAIL lines above)"
  train_args "$@"
  "$PY" -m monarch_sky "${TRAIN[@]}"
}

cluster_train_args() {  # the cluster role's `monarch-sky train` words, in TRAIN: every node's the same but its own IP
  local addrs=() replace=() ip g
  for ip in "${IPS[@]}"; do
    for ((g = 0; g < PER_NODE; g++)); do addrs+=("$ip:$((PORT + g))"); done
  done
  if [ "${HOST_REPLACEMENT:-none}" = "skypilot" ]; then  # needs `sky` and credentials here
    need RECIPE_YAML
    replace=(hosts.provider=skypilot hosts.recipe_yaml="$RECIPE_YAML")
  fi
  CLUSTER_ADDRS=$(IFS=,; echo "${addrs[*]}")
  # the spare nodes' workers are the last addresses: the provider keeps those beyond the groups'
  train_args "$CLUSTER_ADDRS" $(((NODES - SPARES) * PER_NODE / PER_GROUP)) hosts.spares=$((SPARES * PER_NODE)) \
    ${replace[@]+"${replace[@]}"}
}

stand_by() {  # node RANK > 0: take the run over if every node before this one loses its controller
  local doors=() r
  for ((r = 0; r < RANK; r++)); do doors+=("${IPS[$r]}:$DOOR"); done
  cluster_train_args
  rm -f "$STATE/took-over"
  "$PY" -m monarch_sky standby --watch "$(IFS=,; echo "${doors[*]}")" --local-worker "$MY_IP:$PORT" \
    --after-s "${TAKEOVER_AFTER_S:-10}" --mark "$STATE/took-over" "${TRAIN[@]}" &
  STANDBY=$!
}

case "$ROLE" in
  worker)
    NAME="node $RANK" ADVERTISE=$MY_IP
    if [ -n "${WORKER_TASK:-}" ] && [ -n "${SKYPILOT_JOBGROUP_NAME:-}" ]; then
      NAME=$WORKER_TASK ADVERTISE=$WORKER_TASK-0.$SKYPILOT_JOBGROUP_NAME
    fi
    doctor "$NAME" ${EXPECT[@]+"${EXPECT[@]}"} || preflight_failed "$NAME"
    start_workers "$ADVERTISE"
    say "$NAME serving until the controller finishes"
    RC=0
    wait_workers || RC=$?
    exit "$RC"
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
    doctor "node $RANK" ${EXPECT[@]+"${EXPECT[@]}"} || preflight_failed "node $RANK"
    start_workers "$MY_IP"
    if [ "$RANK" -ne 0 ]; then
      stand_by
      say "node $RANK serving until the controller on ${IPS[0]} finishes; standing by to take the run over if that node is lost"
      RC=0
      wait_workers || RC=$?
      SRC=0
      wait "$STANDBY" || SRC=$?
      if [ -f "$STATE/took-over" ]; then
        RC=$SRC  # this node's controller drove the run to its end: its verdict
      elif [ "$RC" -ne 0 ]; then
        # A non-zero run on one node makes SkyPilot cancel every node's run (Ray-based infras:
        # backends/task_codegen.py; Slurm: srun --kill-on-bad-exit): the run would end for a loss
        # the controller already absorbs (the group goes on on a spare, a comeback, or not at all).
        say "node $RANK: its worker ended with status $RC; the run goes on without it (node 0's summary says how), so this node's run exits 0"
        RC=0
      fi
      exit "$RC"
    fi
    cluster_train_args
    doctor "controller" --workers "$CLUSTER_ADDRS" --wait "${WORKER_WAIT_S:-600}" \
      || die "not every worker answers (see the FAIL lines above)"
    RC=0
    "$PY" -m monarch_sky "${TRAIN[@]}" || RC=$?
    wait_workers || true  # the controller's status is this node's: it has judged every worker
    exit "$RC"
    ;;
esac
