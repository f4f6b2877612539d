#!/usr/bin/env bash
# /entrypoint of the Airflow image when it is built on a plain Debian base (docker/airflow.Dockerfile), doing
# what the official image's entrypoint does for the commands the stack runs: `bash ...` and `python ...` run as
# given, so does an absolute path; anything else is an Airflow subcommand (`api-server`, `scheduler`,
# `celery worker`, with or without a leading `airflow`). Only those: `celery` is also a program on PATH (Celery's
# own CLI), and `celery worker --celery-hostname ...` must reach Airflow's command, not Celery's.
# umask 0002: files the tasks write in the shared work folder stay writable for the other containers' users,
# which share GID 0.
set -euo pipefail
umask 0002
if [[ $# -eq 0 ]]; then
  exec bash
fi
case "$1" in
  bash | python | python3 | /*) exec "$@" ;;
  airflow) shift ;;
esac
exec airflow "$@"
