#!/usr/bin/env bash
# A real single-node Slurm cluster for tests, from Debian's packages: munged, slurmctld and
# slurmd started in the foreground as root, stopped by PID.
#
#   source scripts/slurm-cluster.sh
#   slurm_cluster_start DIR     # installs the packages if missing; exit status 3 if they cannot be
#   ...                         # SLURM_CONF is exported; srun, sbatch, scontrol talk to it
#   slurm_cluster_stop
#
# The node declares 8 CPUs whatever the machine has (SlurmdParameters=config_overrides), so two
# 2-task jobs can run at once on a small VM. No cgroups (proctrack/linuxproc, task/none): it
# runs in containers.

SLURM_PACKAGES=(slurmctld slurmd slurm-client munge)

slurm_cluster_install() {
    local missing=0 cmd
    for cmd in srun sbatch scontrol squeue slurmctld slurmd munged; do
        command -v "$cmd" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin" command -v "$cmd" >/dev/null 2>&1 || missing=1
    done
    [ "$missing" = 0 ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "slurm-cluster: Slurm is not installed and cannot be installed here (needs root and apt-get)"
        return 3
    fi
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${SLURM_PACKAGES[@]}" >"${SLURM_DIR:-/tmp}/apt.log" 2>&1; then
        # A stale package list: refresh it once.
        DEBIAN_FRONTEND=noninteractive apt-get update >>"${SLURM_DIR:-/tmp}/apt.log" 2>&1 || true
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            "${SLURM_PACKAGES[@]}" >>"${SLURM_DIR:-/tmp}/apt.log" 2>&1; then
            echo "slurm-cluster: Debian's ${SLURM_PACKAGES[*]} could not be installed:"
            tail -n 5 "${SLURM_DIR:-/tmp}/apt.log"
            return 3
        fi
    fi
}

# Waits up to $2 seconds for command $1 to succeed.
slurm_wait_for() {
    local i
    for ((i = 0; i < $2 * 4; i++)); do
        eval "$1" >/dev/null 2>&1 && return 0
        sleep 0.25
    done
    return 1
}

slurm_cluster_start() {
    SLURM_DIR=$(realpath -m "$1")
    mkdir -p "$SLURM_DIR"
    if [ "$(id -u)" != 0 ]; then
        echo "slurm-cluster: starting munged, slurmctld and slurmd as here needs root"
        return 3
    fi
    slurm_cluster_install || return $?
    export PATH="$PATH:/usr/sbin"
    local host
    host=$(hostname -s)
    mkdir -p "$SLURM_DIR"/{state,spool,log,munge}
    chown munge:munge "$SLURM_DIR/munge" 2>/dev/null || true
    chmod 0700 "$SLURM_DIR/munge"
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    # munged's default socket is where Slurm's auth/munge looks for it.
    mkdir -p /run/munge
    chown munge:munge /run/munge
    chmod 0755 /run/munge
    runuser -u munge -- munged -F --force --log-file="$SLURM_DIR/munge/munged.log" \
        --pid-file="$SLURM_DIR/munge/munged.pid" --seed-file="$SLURM_DIR/munge/munged.seed" \
        >"$SLURM_DIR/log/munged.out" 2>&1 &
    SLURM_MUNGED_PID=$!
    if ! slurm_wait_for "munge -n | unmunge" 10; then
        echo "slurm-cluster: munged did not answer within 10 s:"
        cat "$SLURM_DIR/log/munged.out" "$SLURM_DIR/munge/munged.log" 2>/dev/null | tail -n 5
        return 1
    fi
    cat >"$SLURM_DIR/slurm.conf" <<EOF
ClusterName=burnddp
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job starts again once its old credential has expired (120 s by default).
AuthInfo=cred_expire=10
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
SchedulerType=sched/builtin
SchedulerParameters=nohold_on_prolog_fail,sched_interval=2
MinJobAge=600
KillWait=5
InactiveLimit=0
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    export SLURM_CONF="$SLURM_DIR/slurm.conf"
    slurmctld -D -i -f "$SLURM_CONF" >"$SLURM_DIR/log/slurmctld.out" 2>&1 &
    SLURM_CTLD_PID=$!
    slurmd -D -f "$SLURM_CONF" >"$SLURM_DIR/log/slurmd.out" 2>&1 &
    SLURM_D_PID=$!
    if ! slurm_wait_for "sinfo -h -o %T | grep -x idle" 30; then
        echo "slurm-cluster: the node is not idle 30 s after start:"
        sinfo 2>&1 | tail -n 3
        tail -n 5 "$SLURM_DIR/log/slurmctld.log" "$SLURM_DIR/log/slurmd.log" 2>/dev/null
        return 1
    fi
}

slurm_cluster_stop() {
    local pid
    if [ -n "${SLURM_CONF:-}" ]; then
        scancel --quiet --user root >/dev/null 2>&1 || true
    fi
    for pid in ${SLURM_D_PID:-} ${SLURM_CTLD_PID:-} ${SLURM_MUNGED_PID:-}; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in ${SLURM_D_PID:-} ${SLURM_CTLD_PID:-} ${SLURM_MUNGED_PID:-}; do
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    SLURM_D_PID= SLURM_CTLD_PID= SLURM_MUNGED_PID=
}
