#!/usr/bin/env bash
# A Ray head node on 127.0.0.1 (the whole cluster: this machine), kept small for a 2-core machine.
#   cluster/ray_head.sh start DIR      # ray start --head --block, in its own session; sweeps attach with
#                                      # hydra.launcher.ray.init.address=127.0.0.1:6379
#   cluster/ray_head.sh stop DIR       # TERM to that `ray start` (it stops the processes it started), then
#                                      # KILL to anything left in its session: by session id, nothing else
# Not `ray stop`: it kills every Ray process of the user on the machine, other people's heads included.
set -euo pipefail

command=${1:?usage: ray_head.sh start|stop DIR}
dir=$(realpath -m "${2:?usage: ray_head.sh $command DIR}")
bin=$(dirname "$(realpath -s "${PYTHON:-python}")")

in_session() { ps -e -o pid=,sid= | awk -v s="$1" '$2 == s {print $1}'; }

if [[ $command == stop ]]; then
    [[ -f $dir/head.pid ]] || exit 0
    sid=$(cat "$dir/head.pid")
    kill -TERM "$sid" 2>/dev/null || true
    for _ in $(seq 1 40); do [[ -z $(in_session "$sid") ]] && break; sleep 0.5; done
    left=$(in_session "$sid")
    if [[ -n $left ]]; then
        echo "ray_head.sh: killing what did not stop in 20 s: $left" >&2
        kill -KILL $left 2>/dev/null || true
    fi
    rm -f "$dir/head.pid"
    exit 0
fi
[[ $command == start ]] || { echo "ray_head.sh: unknown command $command" >&2; exit 2; }
mkdir -p "$dir"
RAY_USAGE_STATS_ENABLED=0 setsid "$bin/ray" start --head --block --node-ip-address=127.0.0.1 --port=6379 \
    --num-cpus="${RAY_NUM_CPUS:-2}" --num-gpus=0 --object-store-memory=$((100 * 1024 * 1024)) \
    --include-dashboard=false --disable-usage-stats --temp-dir="$dir" >"$dir/start.log" 2>&1 &
echo $! > "$dir/head.pid"
for _ in $(seq 1 120); do
    if grep -q "Ray runtime started" "$dir/start.log"; then
        echo "ray head: 127.0.0.1:6379 (num_cpus ${RAY_NUM_CPUS:-2}, pid $(cat "$dir/head.pid"), files under $dir)"
        exit 0
    fi
    kill -0 "$(cat "$dir/head.pid")" 2>/dev/null || break
    sleep 0.5
done
echo "ray_head.sh: the head did not start; its output:" >&2
tail -30 "$dir/start.log" >&2
exit 1
