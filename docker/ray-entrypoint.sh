#!/usr/bin/env bash
# Starts one Ray node in the foreground (`ray start --block`), as the container's main process.
#
#   RAY_NODE_TYPE       head | worker (default head)
#   RAY_HEAD_ADDRESS    worker only: the head's GCS address, host:port (e.g. ray-head:6379)
#   RAY_GCS_PORT        head only: GCS port (default 6379)
#   RAY_DASHBOARD_PORT  head only: dashboard / job server port (default 8265)
#   RAY_NUM_GPUS        GPUs this node offers to Ray (head default 0, so training actors land on the workers;
#                       worker default: Ray detects them from CUDA_VISIBLE_DEVICES / NVML)
#   RAY_START_ARGS      extra `ray start` flags, split on spaces (e.g. "--num-cpus=32 --resources={\"trainer\":1}")
#   RAY_AUTH_MODE, RAY_AUTH_TOKEN  read by Ray itself (token authentication of the dashboard, jobs and GCS)
#   RAY_PREEMPTION_GRACE_S  worker only: seconds a SIGTERM to the container (a node drained or preempted) waits
#                       for the node's training ranks before stopping Ray (default 30; set it to the runs'
#                       trainer.preemption_grace_s, and the orchestrator's grace period above it)
#
# A worker node passes a SIGTERM on to its Ray worker processes first: a training rank takes it as the run's
# preemption notice (workers/preemption.py), the trainer checkpoints at the end of the running step and ends the
# job, which ends the ranks; then (or after RAY_PREEMPTION_GRACE_S) Ray stops and the container exits.
# `ray-entrypoint.sh drain` does the first part alone (a preStop hook where another launcher runs `ray start`).
#
# Any other command (`docker run IMAGE python ...`) is executed as given, so the image also serves one-off jobs.
set -euo pipefail
# Files written in shared volumes stay writable for the other containers' users (all in group 0).
umask 0002

# The node's Ray worker processes, this container's only: Ray names them ray::<class>[.<method>] (idle ones
# ray::IDLE), and its own agents ray::DashboardAgent and ray::RuntimeEnvAgent, which are left alone (the raylet
# stops when one of them dies). Idle workers get the SIGTERM too but are not waited for (Ray may start new ones).
worker_pids() { ps -eo pid=,args= | awk -v idle="$1" '$2 ~ /^ray::/ && $2 !~ /^ray::[A-Za-z]*Agent$/ \
  && (idle || $2 != "ray::IDLE") { print $1 }'; }
ray_workers() { worker_pids 0; }

# SIGTERM to every Ray worker process of this node, then wait up to RAY_PREEMPTION_GRACE_S for the busy ones to end.
drain_workers() {
  local grace=${RAY_PREEMPTION_GRACE_S:-30} deadline pids
  deadline=$((SECONDS + ${grace%.*}))
  pids=$(worker_pids 1)
  echo "ray-entrypoint: passing SIGTERM to the node's Ray worker processes ($(echo "$pids" | grep -c .)), then" \
    "waiting up to ${grace} s for them to end" >&2
  # shellcheck disable=SC2086  # one pid per word
  [ -z "$pids" ] || kill -TERM $pids 2>/dev/null || true
  while [ -n "$(ray_workers)" ] && [ $SECONDS -lt "$deadline" ]; do sleep 0.5; done
  echo "ray-entrypoint: $(ray_workers | grep -c .) busy Ray worker process(es) left" >&2
}

ray_pid=""
stopping=0
drain_then_stop() {
  trap '' TERM INT
  stopping=1
  drain_workers
  [ -z "$ray_pid" ] || kill -TERM "$ray_pid" 2>/dev/null || true
}

# `ray-entrypoint.sh drain`: the drain alone, for a node whose `ray start` another launcher runs (a Kubernetes
# preStop hook under KubeRay: the pod's SIGTERM follows once the hook returns).
if [[ "${1:-}" == drain ]]; then
  drain_workers
  exit 0
fi

if [[ $# -gt 0 ]]; then
  exec "$@"
fi

# shellcheck disable=SC2206  # word splitting of RAY_START_ARGS is the point
extra=(${RAY_START_ARGS:-})
case "${RAY_NODE_TYPE:-head}" in
  head)
    exec ray start --head --block --disable-usage-stats \
      --port="${RAY_GCS_PORT:-6379}" \
      --dashboard-host=0.0.0.0 --dashboard-port="${RAY_DASHBOARD_PORT:-8265}" \
      --num-gpus="${RAY_NUM_GPUS:-0}" \
      "${extra[@]}"
    ;;
  worker)
    gpus=()
    if [[ -n "${RAY_NUM_GPUS:-}" ]]; then
      gpus=(--num-gpus="${RAY_NUM_GPUS}")
    fi
    # The trap goes in before Ray starts: a notice that arrives while the node is still starting is kept (Ray is
    # then stopped as soon as it has a pid), never lost to bash's default action with `ray start` left running.
    trap 'drain_then_stop' TERM INT
    ray start --block --disable-usage-stats \
      --address="${RAY_HEAD_ADDRESS:?set RAY_HEAD_ADDRESS to the head GCS address, e.g. ray-head:6379}" \
      "${gpus[@]}" "${extra[@]}" &
    ray_pid=$!
    if [[ $stopping == 1 ]]; then kill -TERM "$ray_pid" 2>/dev/null || true; fi
    # `wait` returns early when a trapped signal arrives; keep waiting while Ray runs.
    # (bash keeps the status of a Ray that has already ended, so the first `wait` always gives it.)
    rc=0
    while :; do
      wait "$ray_pid" && rc=0 || rc=$?
      kill -0 "$ray_pid" 2>/dev/null || break
    done
    exit "$rc"
    ;;
  *)
    echo "ray-entrypoint: RAY_NODE_TYPE must be 'head' or 'worker', got '${RAY_NODE_TYPE}'" >&2
    exit 2
    ;;
esac
