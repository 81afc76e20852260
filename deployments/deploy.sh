#!/usr/bin/env bash
# Create the work pool if needed and (re)deploy every deployment in prefect.yaml. Idempotent.
set -euo pipefail
source "$(dirname "$0")/common.sh"
load_credentials
cd "$CPUFORGE_HOME"
ensure_work_pool
prefect --no-prompt deploy --all
