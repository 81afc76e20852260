#!/usr/bin/env bash
# A Prefect worker for the "cpuforge" process work pool, on the machine whose CPUs do the training.
# Each flow run is a fresh Python process in $CPUFORGE_HOME (this checkout) that inherits this
# environment: PREFECT_API_URL, MLFLOW_TRACKING_URI and CPUFORGE_HOME reach the flow from here.
# Start one per training machine, each pointing at the team's servers:
#   PREFECT_API_URL=http://prefect.internal:4200/api MLFLOW_TRACKING_URI=http://mlflow.internal:5000 \
#     bash deployments/worker.sh
# with the servers' credentials in $CPUFORGE_CREDENTIALS (a copy of theirs, mode 0600) or in the
# environment (PREFECT_API_AUTH_STRING, MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD).
# Whoever can trigger a deployment chooses its parameters: the paths they name must lie in
# CPUFORGE_ALLOWED_ROOTS (colon-separated, default the checkout's cpuforge-runs; never the checkout
# itself, which holds the code the runs execute), and a Dask scheduler in CPUFORGE_DASK_ALLOWED.
set -euo pipefail
source "$(dirname "$0")/common.sh"
load_credentials
export CPUFORGE_ALLOWED_ROOTS="${CPUFORGE_ALLOWED_ROOTS:-$CPUFORGE_HOME/cpuforge-runs}"
IFS=: read -ra roots <<<"$CPUFORGE_ALLOWED_ROOTS"
mkdir -p "${roots[@]}"
ensure_work_pool
cd "$CPUFORGE_HOME"
# CPUFORGE_WORKER_LIMIT=1: at most one flow run at a time here, so the next one goes to another worker.
exec prefect worker start --pool "$CPUFORGE_WORK_POOL" --type process --name "cpuforge-$(hostname)" \
  ${CPUFORGE_WORKER_LIMIT:+--limit "$CPUFORGE_WORKER_LIMIT"}
