#!/usr/bin/env bash
# The Prefect server: API and UI on http://$CPUFORGE_BIND:$PREFECT_PORT (default 127.0.0.1:4200).
# Its database is SQLite in $CPUFORGE_STATE/prefect; for a team, use PostgreSQL:
#   PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://USER:PASSWORD@HOST:5432/prefect
set -euo pipefail
source "$(dirname "$0")/common.sh"
export PREFECT_HOME="$CPUFORGE_STATE/prefect"
mkdir -p "$PREFECT_HOME"
exec prefect server start --host "$CPUFORGE_BIND" --port "$PREFECT_PORT"
