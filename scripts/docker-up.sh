#!/bin/sh
# Makes sure a Docker engine answers on this machine. Idempotent; safe to run again and again.
#
#   1. installs Debian's docker.io (the engine) and debootstrap (for the offline base image)
#      with apt when they are missing;
#   2. starts dockerd in the background when no engine answers (log: $DOCKERD_LOG);
#   3. waits until `docker info` answers, or fails after $DOCKER_UP_TIMEOUT seconds.
#
# Needs root for steps 1 and 2; where an engine already answers it needs neither.
set -eu

log_file="${DOCKERD_LOG:-/var/log/dockerd.log}"
timeout_s="${DOCKER_UP_TIMEOUT:-60}"

say() { echo "docker-up: $*" >&2; }

engine_answers() { docker info >/dev/null 2>&1; }

need_packages() {
    missing=""
    command -v dockerd >/dev/null 2>&1 || missing="$missing docker.io"
    command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
    # docker.io brings its own client; a client installed elsewhere is fine too.
    command -v docker >/dev/null 2>&1 || missing="$missing docker.io"
    echo "$missing"
}

install_packages() {
    missing="$(need_packages)"
    [ -z "$missing" ] && return 0
    if [ "$(id -u)" != 0 ]; then
        say "missing:$missing; run this script as root (or install them) and try again"
        exit 1
    fi
    say "installing:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086  # word splitting of the package list is wanted
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

start_engine() {
    if [ "$(id -u)" != 0 ]; then
        say "no Docker engine answers and only root can start one"
        exit 1
    fi
    mkdir -p "$(dirname "$log_file")"
    say "starting dockerd (log: $log_file)"
    # setsid: the engine outlives this script and the shell that ran it.
    setsid dockerd >>"$log_file" 2>&1 </dev/null &
}

wait_for_engine() {
    waited=0
    until engine_answers; do
        if [ "$waited" -ge "$timeout_s" ]; then
            say "dockerd did not answer within ${timeout_s}s; last lines of $log_file:"
            tail -n 20 "$log_file" >&2 || true
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
}

install_packages
if engine_answers; then
    exit 0
fi
# A dockerd that is starting (or stuck) already: wait for it rather than start a second one.
if ! pgrep -x dockerd >/dev/null 2>&1; then
    start_engine
fi
wait_for_engine
say "engine up: $(docker info --format '{{.ServerVersion}} ({{.Driver}}, cgroup v{{.CgroupVersion}})')"
