# Settings shared by the scripts in deployments/ (sourced, not run). Each can be set in the
# environment first; everything binds to loopback unless CPUFORGE_BIND says otherwise.
CPUFORGE_HOME="${CPUFORGE_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"  # this checkout
CPUFORGE_STATE="${CPUFORGE_STATE:-$HOME/.cpuforge}"  # server databases, MLflow artifacts, logs, PID files
CPUFORGE_BIND="${CPUFORGE_BIND:-127.0.0.1}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
CPUFORGE_WORK_POOL=cpuforge  # the pool prefect.yaml deploys to

# Where clients (the worker, `prefect deploy`, flow runs) find the servers.
export PREFECT_API_URL="${PREFECT_API_URL:-http://$CPUFORGE_BIND:$PREFECT_PORT/api}"
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-http://$CPUFORGE_BIND:$MLFLOW_PORT}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export CPUFORGE_HOME CPUFORGE_STATE

# prefect, mlflow and cpuforge from the checkout's virtual environment when it has one.
if [[ -x "$CPUFORGE_HOME/.venv/bin/prefect" ]]; then
  export PATH="$CPUFORGE_HOME/.venv/bin:$PATH"
fi

ensure_work_pool() {  # the process pool prefect.yaml deploys to, created once
  prefect work-pool inspect "$CPUFORGE_WORK_POOL" >/dev/null 2>&1 ||
    prefect work-pool create "$CPUFORGE_WORK_POOL" --type process
}
