#!/usr/bin/env bash
# The Prefect server: API and UI on http://$CPUFORGE_BIND:$PREFECT_PORT (default 127.0.0.1:4200).
# Its database is SQLite in $CPUFORGE_STATE/prefect; for a team, use PostgreSQL:
#   PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://USER:PASSWORD@HOST:5432/prefect
# Every API call but the health check needs PREFECT_API_AUTH_STRING (from $CPUFORGE_CREDENTIALS).
set -euo pipefail
source "$(dirname "$0")/common.sh"
refuse_open_without_auth
ensure_credentials
if auth_on; then
  export PREFECT_SERVER_API_AUTH_STRING="${PREFECT_API_AUTH_STRING:?no PREFECT_API_AUTH_STRING in $CPUFORGE_CREDENTIALS}"
fi
export PREFECT_HOME="$CPUFORGE_STATE/prefect"
mkdir -p "$PREFECT_HOME"
exec prefect server start --host "$CPUFORGE_BIND" --port "$PREFECT_PORT"
