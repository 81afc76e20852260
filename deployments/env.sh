# Source it (`source deployments/env.sh`) so that prefect, mlflow and cpuforge in this shell reach the
# stack up.sh started, with its credentials: PREFECT_API_URL, MLFLOW_TRACKING_URI,
# PREFECT_API_AUTH_STRING, MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
load_credentials
