# Settings shared by the scripts in deployments/ (sourced, not run). Each can be set in the
# environment first; everything binds to loopback unless CPUFORGE_BIND says otherwise.
CPUFORGE_HOME="${CPUFORGE_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"  # this checkout
CPUFORGE_STATE="${CPUFORGE_STATE:-$HOME/.cpuforge}"  # server databases, MLflow artifacts, logs, PID files
CPUFORGE_BIND="${CPUFORGE_BIND:-127.0.0.1}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
CPUFORGE_WORK_POOL=cpuforge  # the pool prefect.yaml deploys to
# Both servers ask for credentials unless CPUFORGE_AUTH=off, which only loopback may use. They are
# generated on the first start into this file (mode 0600; never in the checkout).
CPUFORGE_AUTH="${CPUFORGE_AUTH:-on}"
CPUFORGE_CREDENTIALS="${CPUFORGE_CREDENTIALS:-$CPUFORGE_STATE/credentials.env}"

# Where clients (the worker, `prefect deploy`, flow runs) find the servers.
export PREFECT_API_URL="${PREFECT_API_URL:-http://$CPUFORGE_BIND:$PREFECT_PORT/api}"
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-http://$CPUFORGE_BIND:$MLFLOW_PORT}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export CPUFORGE_HOME CPUFORGE_STATE CPUFORGE_AUTH CPUFORGE_CREDENTIALS

# prefect, mlflow and cpuforge from the checkout's virtual environment when it has one.
if [[ -x "$CPUFORGE_HOME/.venv/bin/prefect" ]]; then
  export PATH="$CPUFORGE_HOME/.venv/bin:$PATH"
fi

ensure_work_pool() {  # the process pool prefect.yaml deploys to, created once
  prefect work-pool inspect "$CPUFORGE_WORK_POOL" >/dev/null 2>&1 ||
    prefect work-pool create "$CPUFORGE_WORK_POOL" --type process
}

auth_on() { [[ "$CPUFORGE_AUTH" != off ]]; }

refuse_open_without_auth() {  # servers: no credentials only where no one else can connect
  case "$CPUFORGE_BIND" in 127.* | localhost | ::1) return 0 ;; esac
  if ! auth_on; then
    echo "refusing to serve on $CPUFORGE_BIND with CPUFORGE_AUTH=off: bind to 127.0.0.1 or turn authentication on" >&2
    exit 1
  fi
}

ensure_credentials() {  # the first start makes random credentials that only this user can read
  auth_on || return 0
  if [[ ! -f "$CPUFORGE_CREDENTIALS" ]]; then
    mkdir -p "$(dirname "$CPUFORGE_CREDENTIALS")"
    (
      umask 077
      python3 -c 'import secrets; t = lambda: secrets.token_urlsafe(24)
print(f"PREFECT_API_AUTH_STRING=cpuforge:{t()}\nMLFLOW_TRACKING_USERNAME=admin\nMLFLOW_TRACKING_PASSWORD={t()}")
print(f"MLFLOW_FLASK_SERVER_SECRET_KEY={t()}\nCPUFORGE_DB_PASSWORD={t()}")' >"$CPUFORGE_CREDENTIALS.$$"
      mv -n "$CPUFORGE_CREDENTIALS.$$" "$CPUFORGE_CREDENTIALS"  # a concurrent first start keeps its own
      rm -f "$CPUFORGE_CREDENTIALS.$$"
    )
    echo "credentials: generated in $CPUFORGE_CREDENTIALS (mode 0600)" >&2
  fi
  load_credentials
}

credential() {  # credential NAME: one value from the credentials file
  sed -n "s/^$1=//p" "$CPUFORGE_CREDENTIALS" | head -n 1
}

load_credentials() {  # export the client credentials from the file, where the environment has none
  auth_on && [[ -f "$CPUFORGE_CREDENTIALS" ]] || return 0
  if [[ -n "$(find "$CPUFORGE_CREDENTIALS" -perm /077)" ]]; then
    echo "refusing $CPUFORGE_CREDENTIALS: others can read it; chmod 600 it (and change the passwords)" >&2
    return 1
  fi
  local name
  for name in PREFECT_API_AUTH_STRING MLFLOW_TRACKING_USERNAME MLFLOW_TRACKING_PASSWORD; do
    [[ -n "${!name:-}" ]] || export "$name=$(credential "$name")"
  done
}
