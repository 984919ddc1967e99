#!/usr/bin/env bash
# A private single-node Slurm cluster on 127.0.0.1 for the Slurm tests.
#   tests/slurm/cluster.sh up DIR     install Debian's Slurm if missing (needs root and apt),
#                                     write DIR/slurm.conf and start slurmctld and slurmd
#   tests/slurm/cluster.sh down DIR   stop both daemons by the pids in DIR
# `up` prints the line to export (SLURM_CONF=...) and exits non-zero when it cannot.
# AuthType=auth/none: no munge; fit for a test machine only, never for a shared one.
set -euo pipefail
cmd=${1:-}
dir=${2:-}
[[ -n "$cmd" && -n "$dir" ]] || { echo "usage: $0 up|down DIR" >&2; exit 2; }

install() {
    command -v slurmctld >/dev/null && command -v sbatch >/dev/null && return
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
        echo "no Slurm here and no root or apt-get to install it" >&2
        return 1
    fi
    echo "installing Slurm (Debian's slurmctld, slurmd, slurm-client) for the Slurm tests..." >&2
    (apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client >/dev/null 2>&1 ||
        (apt-get update -q >/dev/null 2>&1 &&
            apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client >/dev/null 2>&1))
}

up() {
    install
    mkdir -p "$dir"/{state,spool,log}
    dir=$(cd "$dir" && pwd)
    local host cpus
    host=$(hostname -s)
    # more CPUs than the machine has: test jobs are mostly idle, and several must run at once
    cpus=8
    cat >"$dir/slurm.conf" <<CONF
ClusterName=pbt-tests
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$((6817 + RANDOM % 50 * 2))
SlurmdPort=$((6918 + RANDOM % 50 * 2))
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=2
InactiveLimit=0
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
    export SLURM_CONF="$dir/slurm.conf"
    /usr/sbin/slurmctld -c
    /usr/sbin/slurmd
    for _ in $(seq 100); do
        if sinfo -h -o %T 2>/dev/null | grep -q idle; then
            echo "export SLURM_CONF=$SLURM_CONF"
            return
        fi
        sleep 0.2
    done
    echo "the Slurm test cluster did not come up; see $dir/log" >&2
    down
    return 1
}

down() {
    for daemon in slurmd slurmctld; do
        [[ -f "$dir/$daemon.pid" ]] && kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
    done
}

case "$cmd" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down DIR" >&2; exit 2 ;;
esac
