#!/usr/bin/env bash
# Run a command against a freshly started `serve run $CONFIG` on 127.0.0.1:8000, then shut it down.
# Usage: scripts/with_serve.sh COMMAND [ARGS...]
set -u
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/cluster.yaml}
VENV=${VENV:-.venv}
LOG=${SERVE_LOG:-/tmp/pegaserve-serve.log}
if curl -sf 127.0.0.1:8000/health >/dev/null 2>&1; then
  echo "something already serves 127.0.0.1:8000; stop it first (serve shutdown -y)" >&2
  exit 2
fi
# Serve's high-throughput mode with HAProxy, as `make serve` (deployments/env.py)
serve_env=$("$VENV/bin/python" -c 'from pegaserve.deployments.env import SERVE_ENV; print(" ".join(f"{k}={v}" for k, v in SERVE_ENV.items()))')
env $serve_env "$VENV/bin/serve" run "$CONFIG" >"$LOG" 2>&1 &
serve_pid=$!
cleanup() {
  # SIGTERM makes `serve run` tear down the app and the Ray instance it started (a background job
  # of a non-interactive shell ignores SIGINT).
  kill -TERM "$serve_pid" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$serve_pid" 2>/dev/null || return; sleep 1; done
  kill -KILL "$serve_pid" 2>/dev/null
}
trap cleanup EXIT
for _ in $(seq 1 240); do
  curl -sf 127.0.0.1:8000/health >/dev/null 2>&1 && break
  kill -0 "$serve_pid" 2>/dev/null || { echo "serve run exited; see $LOG" >&2; exit 1; }
  sleep 1
done
curl -sf 127.0.0.1:8000/health >/dev/null || { echo "pegaserve did not become healthy; see $LOG" >&2; exit 1; }
"$@"
