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
#
# Any other command (`docker run IMAGE python ...`) is executed as given, so the image also serves one-off jobs.
set -euo pipefail
# Files written in shared volumes stay writable for the other containers' users (all in group 0).
umask 0002

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
    exec ray start --block --disable-usage-stats \
      --address="${RAY_HEAD_ADDRESS:?set RAY_HEAD_ADDRESS to the head GCS address, e.g. ray-head:6379}" \
      "${gpus[@]}" "${extra[@]}"
    ;;
  *)
    echo "ray-entrypoint: RAY_NODE_TYPE must be 'head' or 'worker', got '${RAY_NODE_TYPE}'" >&2
    exit 2
    ;;
esac
