#!/usr/bin/env bash
# Makes podman usable on this machine kind (root, no image registry, hybrid cgroups) and builds the local
# Debian base image every Dockerfile can start from. Idempotent; every step is skipped when already done.
#
#   bash docker/podman-setup.sh            # podman + runc + debootstrap, containers.conf, local/debian:bookworm
#   bash docker/podman-setup.sh --check    # exit 0 only if podman runs a container here (prints why not)
#
# Why each setting: setting rlimits is not permitted in these sandboxes (default_ulimits = []); crun refuses
# the hybrid cgroup layout (runtime = "runc"); registries are unreachable, so the base is made with
# debootstrap from Debian's package mirror and imported.
set -euo pipefail

BASE_IMAGE=${RLHF_LOCAL_BASE_IMAGE:-local/debian:bookworm}
SUITE=${RLHF_LOCAL_BASE_SUITE:-bookworm}
CONF=/etc/containers/containers.conf

die() { echo "podman-setup: $*" >&2; exit 1; }

install_packages() {
  local missing=()
  command -v podman >/dev/null 2>&1 || missing+=(podman)
  command -v runc >/dev/null 2>&1 || missing+=(runc)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "${missing[*]} missing; run as root: apt-get install -y podman runc debootstrap"
  command -v apt-get >/dev/null 2>&1 || die "${missing[*]} missing and no apt-get here; install podman >= 4"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
    || die "apt-get install ${missing[*]} failed (no package mirror reachable?)"
}

write_conf() {
  # Only when the file does not set these yet: an administrator's own settings win.
  [ "$(id -u)" = 0 ] || return 0
  mkdir -p /etc/containers
  if ! grep -qs '^ *default_ulimits' "$CONF" || ! grep -qs '^ *runtime *= *"runc"' "$CONF"; then
    if [ -s "$CONF" ]; then cp "$CONF" "$CONF.rlhf-backup"; fi
    cat >"$CONF" <<'CONF'
# Written by rlhf-ops docker/podman-setup.sh (the previous file, if any, is containers.conf.rlhf-backup).
[containers]
# Setting rlimits is not permitted in this sandbox; podman's defaults (nproc, nofile) would fail every run.
default_ulimits = []

[engine]
# crun refuses this machine's hybrid cgroup layout; runc works.
runtime = "runc"
CONF
  fi
}

check_runs() {
  podman image exists "$BASE_IMAGE" || return 1
  podman run --rm --network host "$BASE_IMAGE" true >/dev/null 2>&1
}

make_base() {
  podman image exists "$BASE_IMAGE" && return 0
  [ "$(id -u)" = 0 ] || die "base image $BASE_IMAGE missing; building it needs root (debootstrap)"
  local dir
  dir=$(mktemp -d /tmp/rlhf-debootstrap.XXXXXX)
  # shellcheck disable=SC2064
  trap "rm -rf '$dir'" EXIT
  debootstrap --variant=minbase "$SUITE" "$dir" >/dev/null \
    || die "debootstrap $SUITE failed (Debian's package mirror unreachable?); see $dir/debootstrap/debootstrap.log"
  # apt inside builds: no recommends, no docs (smaller images).
  printf 'APT::Install-Recommends "false";\n' >"$dir/etc/apt/apt.conf.d/90norecommends"
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$dir"
  trap - EXIT
}

if [ "${1:-}" = "--check" ]; then
  command -v podman >/dev/null 2>&1 || { echo "podman is not installed (bash docker/podman-setup.sh)"; exit 1; }
  check_runs || { echo "podman cannot run $BASE_IMAGE here (bash docker/podman-setup.sh)"; exit 1; }
  exit 0
fi
install_packages
write_conf
make_base
check_runs || die "podman cannot run a container from $BASE_IMAGE; try: podman run --rm --network host $BASE_IMAGE true"
echo "podman ready: $(podman --version), base image $BASE_IMAGE"
