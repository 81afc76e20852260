#!/usr/bin/env bash
# The MLflow tracking server and UI on http://$CPUFORGE_BIND:$MLFLOW_PORT (default 127.0.0.1:5000).
# Runs and the model registry go to SQLite in $CPUFORGE_STATE/mlflow, artifacts next to it; the
# server proxies artifact uploads and downloads, so clients need no access to that folder.
# For a team (needs the PostgreSQL driver: `pip install -e ".[postgres]"`):
#   MLFLOW_BACKEND_STORE_URI=postgresql://USER:PASSWORD@HOST:5432/mlflow
#   MLFLOW_ARTIFACTS_DESTINATION=s3://bucket/cpuforge (or a folder on shared storage)
# Reached by other machines (CPUFORGE_BIND=0.0.0.0)? Name the host it is reached by:
#   MLFLOW_ALLOWED_HOSTS=mlflow.example.internal
# MLflow's basic-auth app: every request but /health needs a user. The admin user is created on the
# first start from $CPUFORGE_CREDENTIALS (MLFLOW_TRACKING_USERNAME / _PASSWORD) in the user database
# MLFLOW_AUTH_DATABASE_URI (default SQLite next to the tracking database); more users: /signup as admin.
set -euo pipefail
source "$(dirname "$0")/common.sh"
refuse_open_without_auth
ensure_credentials
mkdir -p "$CPUFORGE_STATE/mlflow"
args=(
  --host "$CPUFORGE_BIND" --port "$MLFLOW_PORT"
  --backend-store-uri "${MLFLOW_BACKEND_STORE_URI:-sqlite:///$CPUFORGE_STATE/mlflow/mlflow.db}"
  --artifacts-destination "${MLFLOW_ARTIFACTS_DESTINATION:-$CPUFORGE_STATE/mlflow/artifacts}"
  --workers "${MLFLOW_WORKERS:-1}"  # each worker holds ~0.5 GB; one is plenty for one team's runs
)
if auth_on; then
  export MLFLOW_AUTH_CONFIG_PATH="$CPUFORGE_STATE/mlflow/basic_auth.ini"
  (umask 077 && cat >"$MLFLOW_AUTH_CONFIG_PATH" <<EOF
[mlflow]
default_permission = READ
database_uri = ${MLFLOW_AUTH_DATABASE_URI:-sqlite:///$CPUFORGE_STATE/mlflow/basic_auth.db}
admin_username = $MLFLOW_TRACKING_USERNAME
auth_cache_ttl_seconds = ${MLFLOW_AUTH_CACHE_SECONDS:-300}
EOF
  )
  # The cache: checking a password (scrypt) took ~0.3 s of CPU here, and a run makes hundreds of
  # requests. With one worker, a password changed through MLflow takes effect at once anyway.
  # The admin password is read when the user database is created, then ignored: it lives there.
  export MLFLOW_AUTH_ADMIN_PASSWORD="$MLFLOW_TRACKING_PASSWORD"
  MLFLOW_FLASK_SERVER_SECRET_KEY="${MLFLOW_FLASK_SERVER_SECRET_KEY:-$(credential MLFLOW_FLASK_SERVER_SECRET_KEY)}"
  export MLFLOW_FLASK_SERVER_SECRET_KEY="${MLFLOW_FLASK_SERVER_SECRET_KEY:?no MLFLOW_FLASK_SERVER_SECRET_KEY in $CPUFORGE_CREDENTIALS}"
  args+=(--app-name basic-auth)
  python -c "import flask_wtf" 2>/dev/null || {
    echo "mlflow-server.sh: MLflow's basic-auth app needs Flask-WTF: pip install -e '.[server]'" >&2; exit 1; }
fi
if [[ -n "${MLFLOW_ALLOWED_HOSTS:-}" ]]; then
  args+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
fi
exec mlflow server "${args[@]}"
