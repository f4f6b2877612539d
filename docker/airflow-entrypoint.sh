#!/usr/bin/env bash
# /entrypoint of the Airflow image when it is built on a plain Debian base (docker/airflow.Dockerfile), doing
# what the official image's entrypoint does for the commands the stack runs: `bash ...` / `python ...` /
# an executable run as given, anything else is an Airflow subcommand (`api-server`, `scheduler`, ...).
# umask 0002: files the tasks write in the shared work folder stay writable for the other containers' users,
# which share GID 0.
set -euo pipefail
umask 0002
if [[ $# -eq 0 ]]; then
  exec bash
fi
if [[ "$1" == "airflow" ]] || ! command -v "$1" >/dev/null 2>&1; then
  [[ "$1" == "airflow" ]] && shift
  exec airflow "$@"
fi
exec "$@"
