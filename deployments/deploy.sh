#!/usr/bin/env bash
# Create the work pool if needed and (re)deploy every deployment in prefect.yaml. Idempotent.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$CPUFORGE_HOME"
prefect work-pool inspect "$CPUFORGE_WORK_POOL" >/dev/null 2>&1 ||
  prefect work-pool create "$CPUFORGE_WORK_POOL" --type process
prefect --no-prompt deploy --all
