#!/usr/bin/env bash
# A Ray head node on 127.0.0.1 (the whole cluster: this machine), kept small for a 2-core machine.
#   cluster/ray_head.sh start DIR      # ray start --head; sweeps attach with hydra.launcher.ray.init.address=127.0.0.1:6379
#   cluster/ray_head.sh stop DIR       # stops this head's processes and their workers, by pid
# Ray's session files go under DIR (--temp-dir), so the head's processes are told apart by that path.
# Not `ray stop`: it kills every Ray process of the user on the machine, other people's heads included.
set -euo pipefail

command=${1:?usage: ray_head.sh start|stop DIR}
dir=$(realpath -m "${2:?usage: ray_head.sh $command DIR}")
bin=$(dirname "$(realpath -s "${PYTHON:-python}")")

descendants() {  # pid...: the pids and all their descendants
    local pid
    for pid in "$@"; do
        echo "$pid"
        descendants $(ps -o pid= --ppid "$pid" 2>/dev/null || true)
    done
}

if [[ $command == stop ]]; then
    roots=$(grep -lsF -- "$dir" /proc/[0-9]*/cmdline | cut -d/ -f3 | grep -vx "$$" || true)
    [[ -n $roots ]] || exit 0
    pids=$(descendants $roots | sort -u)
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 1 30); do
        alive=$(for p in $pids; do kill -0 "$p" 2>/dev/null && echo "$p"; done)
        [[ -z $alive ]] && exit 0
        sleep 0.5
    done
    echo "ray_head.sh: killing what did not stop in 15 s: $alive" >&2
    kill -KILL $alive 2>/dev/null || true
    exit 0
fi
[[ $command == start ]] || { echo "ray_head.sh: unknown command $command" >&2; exit 2; }
mkdir -p "$dir"
RAY_USAGE_STATS_ENABLED=0 "$bin/ray" start --head --node-ip-address=127.0.0.1 --port=6379 \
    --num-cpus="${RAY_NUM_CPUS:-2}" --num-gpus=0 --object-store-memory=$((100 * 1024 * 1024)) \
    --include-dashboard=false --disable-usage-stats --temp-dir="$dir" >"$dir/start.log" 2>&1 \
    || { echo "ray_head.sh: ray start failed; its output:" >&2; tail -30 "$dir/start.log" >&2; exit 1; }
echo "ray head: 127.0.0.1:6379 (num_cpus ${RAY_NUM_CPUS:-2}, session files under $dir)"
