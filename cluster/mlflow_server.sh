#!/usr/bin/env bash
# A real MLflow tracking server on 127.0.0.1: sqlite backend, artifacts proxied over HTTP (--serve-artifacts).
#   cluster/mlflow_server.sh start DIR [PORT]   # DIR/mlflow.db, DIR/artifacts, DIR/server.log; waits until it answers
#   cluster/mlflow_server.sh stop DIR           # stops it (its process group) and waits
# Points then log with tracking.tracking_uri=http://127.0.0.1:PORT (default 5000).
set -euo pipefail

command=${1:?usage: mlflow_server.sh start|stop DIR [PORT]}
dir=$(realpath -m "${2:?usage: mlflow_server.sh $command DIR [PORT]}")
port=${3:-5000}
bin=${MLFLOW:-$(dirname "$(realpath -s "${PYTHON:-python}")")/mlflow}

if [[ $command == stop ]]; then
    [[ -f $dir/server.pid ]] || exit 0
    pid=$(cat "$dir/server.pid")
    kill -TERM -- "-$pid" 2>/dev/null || true  # the server and its workers: one process group (setsid)
    for _ in $(seq 1 40); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 -- "-$pid" 2>/dev/null; then echo "mlflow_server.sh: did not stop in 20 s: killed" >&2; kill -KILL -- "-$pid"; fi
    rm -f "$dir/server.pid"
    exit 0
fi

[[ $command == start ]] || { echo "mlflow_server.sh: unknown command $command" >&2; exit 2; }
mkdir -p "$dir/artifacts"
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$bin" server --host 127.0.0.1 --port "$port" --workers 1 \
    --backend-store-uri "sqlite:///$dir/mlflow.db" --serve-artifacts --artifacts-destination "$dir/artifacts" \
    >"$dir/server.log" 2>&1 &
echo $! > "$dir/server.pid"
for _ in $(seq 1 120); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
        echo "mlflow server: http://127.0.0.1:$port (pid $(cat "$dir/server.pid"), store $dir/mlflow.db)"
        exit 0
    fi
    kill -0 "$(cat "$dir/server.pid")" 2>/dev/null || break
    sleep 0.5
done
echo "mlflow_server.sh: the server did not answer on 127.0.0.1:$port; its log:" >&2
tail -20 "$dir/server.log" >&2
exit 1
