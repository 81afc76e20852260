#!/usr/bin/env bash
# Stop what up.sh started, by the PIDs it recorded: each service's whole process group gets
# SIGTERM, then SIGINT (a Prefect worker waits for it), then SIGKILL if it is still there.
set -uo pipefail
source "$(dirname "$0")/common.sh"
pids="$CPUFORGE_STATE/pids"

stop() {
  local name=$1 file="$pids/$1.pid"
  [[ -f "$file" ]] || return 0
  local pid
  pid="$(cat "$file")"
  for signal in TERM INT KILL; do
    kill -0 -- "-$pid" 2>/dev/null || break
    kill "-$signal" -- "-$pid" 2>/dev/null
    for ((i = 0; i < 20; i++)); do
      kill -0 -- "-$pid" 2>/dev/null || break
      sleep 0.5
    done
  done
  rm -f "$file"
  echo "$name: stopped (PID $pid)"
}

stop worker  # first, so no flow run starts while the servers go away
stop mlflow-server
stop prefect-server
