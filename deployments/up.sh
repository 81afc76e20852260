#!/usr/bin/env bash
# The whole stack on this machine, in the background: Prefect server, MLflow server, the flows
# deployed from prefect.yaml, and a worker. Logs and PID files go to $CPUFORGE_STATE; stop it all
# with deployments/down.sh. A service whose PID file names a live process is left running.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/common.sh"
refuse_open_without_auth
ensure_credentials  # before the servers start, so both read the same new file
logs="$CPUFORGE_STATE/logs" pids="$CPUFORGE_STATE/pids"
mkdir -p "$logs" "$pids"

running() { [[ -f "$pids/$1.pid" ]] && kill -0 "$(cat "$pids/$1.pid")" 2>/dev/null; }

start() {  # start NAME SCRIPT: run it in a session of its own, so down.sh can stop its children too
  local name=$1 script=$2
  if running "$name"; then
    echo "$name: already running (PID $(cat "$pids/$name.pid"))"
    return
  fi
  setsid bash "$here/$script" >"$logs/$name.log" 2>&1 </dev/null &
  echo $! >"$pids/$name.pid"
  echo "$name: started (PID $!, log $logs/$name.log)"
}

wait_until_up() {  # wait_until_up NAME URL SECONDS
  local name=$1 url=$2 seconds=$3
  for ((i = 0; i < seconds; i++)); do
    if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url" 2>/dev/null; then
      echo "$name: up at $url"
      return
    fi
    if ! running "$name"; then
      echo "$name: exited while starting; the end of $logs/$name.log:" >&2
      tail -n 30 "$logs/$name.log" >&2
      exit 1
    fi
    sleep 1
  done
  echo "$name: not answering at $url after ${seconds}s; see $logs/$name.log" >&2
  exit 1
}

start prefect-server prefect-server.sh
start mlflow-server mlflow-server.sh
wait_until_up prefect-server "$PREFECT_API_URL/health" 180
wait_until_up mlflow-server "$MLFLOW_TRACKING_URI/health" 240
bash "$here/deploy.sh" >"$logs/deploy.log" 2>&1 || { cat "$logs/deploy.log" >&2; exit 1; }
echo "deployments: $(grep -c '^  - name:' "$CPUFORGE_HOME/prefect.yaml") deployed to work pool $CPUFORGE_WORK_POOL (log $logs/deploy.log)"
start worker worker.sh

echo
echo "Prefect UI: ${PREFECT_API_URL%/api}    MLflow UI: $MLFLOW_TRACKING_URI"
if auth_on; then
  echo "Log in:     user and password in $CPUFORGE_CREDENTIALS (Prefect: the PREFECT_API_AUTH_STRING value)"
  echo "This shell: source deployments/env.sh    (prefect, mlflow and cpuforge then use the stack and its credentials)"
fi
echo "Run one:    prefect deployment run cpuforge-pipeline/tiny    (or Deployments -> tiny -> Run in the UI)"
echo "Stop all:   bash deployments/down.sh"
