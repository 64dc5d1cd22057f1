#!/usr/bin/env bash
# A one-node SLURM cluster on 127.0.0.1 from Debian's packages (slurmctld, slurmd, slurm-client, munge),
# every file under one state folder, so it starts and stops without touching /etc/slurm or /run/munge:
#   cluster/slurm.sh install          # apt-get install (root)
#   cluster/slurm.sh start DIR        # munged + slurmctld + slurmd on 127.0.0.1; prints `export SLURM_CONF=…`
#   cluster/slurm.sh stop DIR         # stops the three daemons (by their pid files) and waits for them
# The node has this machine's cores and 8 GB; one partition `debug`. Run it inside a network namespace
# whose only interface is loopback (cluster/test_cluster.sh does): the daemons listen on 6817/6818.
set -euo pipefail

command=${1:?usage: slurm.sh install|start DIR|stop DIR}

if [[ $command == install ]]; then
    [[ $(id -u) == 0 ]] || { echo "slurm.sh install: needs root (apt-get)" >&2; exit 1; }
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
            || ! command -v munged >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 \
            slurmctld slurmd slurm-client munge >/dev/null
    fi
    exit 0
fi

dir=$(realpath -m "${2:?usage: slurm.sh $command DIR}")
conf=$dir/slurm.conf

stop_pidfile() {  # name pidfile: TERM, wait up to 20 s, then KILL
    local name=$1 file=$2 pid
    [[ -f $file ]] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null; then echo "slurm.sh: $name ($pid) did not stop: killed" >&2; kill -9 "$pid"; fi
    fi
    rm -f "$file"
}

if [[ $command == stop ]]; then
    stop_pidfile slurmd "$dir/slurmd.pid"
    stop_pidfile slurmctld "$dir/slurmctld.pid"
    stop_pidfile munged "$dir/munged.pid"
    exit 0
fi

[[ $command == start ]] || { echo "slurm.sh: unknown command $command" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "slurm.sh start: the daemons run as root here (SlurmUser=root)" >&2; exit 1; }
"$0" stop "$dir"  # daemons of an earlier start on this folder
mkdir -p "$dir"/{spool,state,log,munge}
chmod 700 "$dir/munge"

# munge: a key of our own and a socket of our own (another munged on this machine is left alone)
[[ -f $dir/munge/munge.key ]] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none;
                                   chmod 400 "$dir/munge/munge.key"; }
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
       --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
munge --socket="$dir/munge/munge.sock" -n </dev/null | unmunge --socket="$dir/munge/munge.sock" >/dev/null \
    || { echo "slurm.sh: munge does not round-trip a credential (see $dir/log/munged.log)" >&2; exit 1; }

cpus=$(nproc)
# cgroup v1 here (a container's hybrid /sys/fs/cgroup, which slurmd's autodetection refuses); nothing is
# constrained (proctrack/linuxproc, task/none), slurmd only needs the plugin to load
echo "CgroupPlugin=cgroup/v1" > "$dir/cgroup.conf"
cat > "$conf" <<CONF
ClusterName=runner-test
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MpiDefault=none
SchedulerType=sched/backfill
NodeName=node1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=node1 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$conf
slurmctld -f "$conf"
slurmd -f "$conf" -N node1
for _ in $(seq 1 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
        echo "export SLURM_CONF=$conf"
        exit 0
    fi
    sleep 0.5
done
echo "slurm.sh: the node did not come up idle in 30 s; sinfo says: $(sinfo -h 2>&1 || true)" >&2
tail -5 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
exit 1
