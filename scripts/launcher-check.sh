#!/usr/bin/env bash
# The classifier example under the launchers clusters use: a real single-node Slurm (Debian's
# slurmctld, slurmd, munge), Open MPI's mpirun and MPICH's mpiexec, as a cluster user runs them.
#
#   scripts/launcher-check.sh CLASSIFIER [OTHER_CLASSIFIER ...]
#
# CLASSIFIER: a built classifier example (target/debug/examples/classifier after
# `cargo test --workspace`, or the release one: Burn 0.21's); each OTHER_CLASSIFIER (the same
# example built for Burn 0.22 or 0.23: each build puts it at that path, so give a copy of each,
# as .ci/run does) goes through checks 1 and 6 too. Files go
# to $LAUNCHER_CHECK_DIR (default: a fresh directory under $TMPDIR, removed when every check
# passed). Run as root (the daemons, apt-get). Checks:
#   1. srun -n2: one job of world size 2, one final accuracy;
#   2. the binary in an sbatch script without srun: refused within seconds, saying "srun";
#   3. sbatch --requeue, `scontrol requeue` after the epoch-1 checkpoint: the requeued job
#      resumes after epoch 1 (SLURM_RESTART_COUNT=1), trains epochs 2-3 only, keeps its files;
#   4. two jobs on the node at once, no MASTER_PORT given: both train (a port per job);
#   5. a task that exits before it joins (exit 127) under --kill-on-bad-exit=1: the step ends
#      within seconds instead of waiting for the rendezvous deadline;
#   6. mpirun -np 2 (Open MPI) and mpiexec -n 2 (MPICH): one job of world size 2, no panic of
#      the dashboard;
#   7. Burn's summary after a requeue counts 3 epochs.
# Where Debian's packages (slurmctld, slurmd, slurm-client, munge, openmpi-bin, mpich) cannot be
# installed it prints a line starting with "skipped:" and exits 0; any failed check exits 1.
# The daemons are stopped by PID at exit.
set -uo pipefail

BIN=${1:?usage: scripts/launcher-check.sh CLASSIFIER [OTHER_CLASSIFIER ...]}
BINS=()
for b in "$@"; do BINS+=("$(realpath "$b")"); done
BIN=${BINS[0]}
WORK=$(realpath -m "${LAUNCHER_CHECK_DIR:-${TMPDIR:-/tmp}/burn-ddp-launchers.$$}")
HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$WORK"
mkdir -p "$WORK"
# Small data: the point is the launch, not the model. Every wait of the library is bounded
# well below the 10-minute default, so a regression fails the check instead of hanging it.
SMALL=(--train-size 1024 --test-size 256 --batch-size 32)
export BURN_DDP_TIMEOUT=${BURN_DDP_TIMEOUT:-120}

failures=0
started=$SECONDS
say() { printf 'launcher-check: %s\n' "$*"; }
pass() { say "ok   $*"; }
fail() {
    say "FAIL $*"
    failures=$((failures + 1))
}
show() { sed 's/^/    | /' "$1" | tail -n "${2:-25}"; }
count() { grep -c -- "$1" "$2" 2>/dev/null || true; }

# shellcheck source=scripts/slurm-cluster.sh
source "$HERE/slurm-cluster.sh"
trap slurm_cluster_stop EXIT

# Waits (bounded) until job $1 has left the queue; prints its final state.
job_wait() {
    local job=$1 limit=${2:-300} state
    for ((i = 0; i < limit * 2; i++)); do
        state=$(squeue -h -j "$job" -o %T 2>/dev/null)
        [ -z "$state" ] && break
        sleep 0.5
    done
    scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2
}

slurm_cluster_start "$WORK/slurm"
rc=$?
if [ "$rc" = 3 ]; then
    say "skipped: the Slurm checks (not root, or Debian's slurmctld, slurmd, slurm-client, munge could not be installed here)"
    slurm=0
elif [ "$rc" != 0 ]; then
    fail "the single-node Slurm cluster did not start"
    exit 1
else
    slurm=1
    say "Slurm $(sinfo -V | cut -d' ' -f2) up in $((SECONDS - started)) s ($(sinfo -h -o '%N %c CPUs %T'))"
fi

if [ "$slurm" = 1 ]; then
    # 1. srun -n2, for each classifier
    for bin in "${BINS[@]}"; do
        t=$SECONDS
        name=$(basename "$bin")
        out="$WORK/srun-$name.out"
        srun -n2 --kill-on-bad-exit=1 "$bin" --epochs 1 "${SMALL[@]}" --out "$WORK/srun-$name" >"$out" 2>&1
        rc=$?
        if [ "$rc" = 0 ] && [ "$(count '2 ranks ×' "$out")" = 1 ] &&
            [ "$(count 'final test accuracy' "$out")" = 1 ]; then
            pass "srun -n2 $name: one job of 2 ranks ($((SECONDS - t)) s)"
        else
            fail "srun -n2 $name (exit $rc): expected one '2 ranks' line and one final accuracy"
            show "$out"
        fi
    done

    # 2. the binary in the batch script itself
    t=$SECONDS
    out="$WORK/nosrun.out"
    job=$(sbatch --parsable -n2 -o "$out" --wrap "$BIN --epochs 1 ${SMALL[*]} --out $WORK/nosrun")
    state=$(job_wait "$job" 120)
    took=$((SECONDS - t))
    if [ "$state" = FAILED ] && grep -q 'srun <program>' "$out" && [ "$took" -lt 60 ]; then
        pass "sbatch without srun: refused in $took s: $(grep -o 'this process is the batch script[^:]*' "$out" | sed -n 1p)"
    else
        fail "sbatch without srun: job $job $state after $took s; expected FAILED within 60 s saying 'srun <program>'"
        show "$out"
    fi

    # 3. a requeue in the middle of training resumes from the checkpoint
    out="$WORK/requeue.out"
    dir="$WORK/requeue"
    cat >"$WORK/requeue.sh" <<EOF
#!/bin/bash
echo "attempt SLURM_RESTART_COUNT=\${SLURM_RESTART_COUNT:-0}"
srun --kill-on-bad-exit=1 "$BIN" --epochs 3 --train-size 4096 --test-size 256 --batch-size 32 --out "$dir"
EOF
    t=$SECONDS
    job=$(sbatch --parsable -n2 --requeue --open-mode=append -o "$out" "$WORK/requeue.sh")
    # Epoch 1's checkpoint is complete once its three records are there: burn-train writes
    # each on a thread of its own (AsyncCheckpointer), so the small scheduler record is often
    # renamed into place while the model's is still being written (a requeue then found no
    # complete checkpoint and the job started again, rightly). Each is renamed into place whole.
    epoch1() { for part in model optim scheduler; do [ -f "$dir/checkpoint/$part-1.bin" ] || return 1; done; }
    for ((i = 0; i < 1200; i++)); do
        epoch1 && break
        sleep 0.25
    done
    if ! epoch1; then
        fail "requeue: no epoch-1 checkpoint within 300 s"
        show "$out"
    else
        # Slurm starts it again once its old credential has expired (cred_expire=10 in
        # slurm-cluster.sh's configuration): forcing an earlier start makes slurmd refuse it.
        scontrol requeue "$job"
        state=$(job_wait "$job" 600)
        took=$((SECONDS - t))
        second=$(sed -n '/^attempt SLURM_RESTART_COUNT=1/,$p' "$out")
        if [ "$state" = COMPLETED ] && grep -q 'attempt SLURM_RESTART_COUNT=1' "$out" &&
            grep -q 'resuming after epoch 1 of 3' <<<"$second" &&
            ! grep -Eq '\[train\] epoch 1/3|Epoch 1/3' <<<"$second" &&
            grep -q 'final test accuracy' <<<"$second"; then
            pass "sbatch --requeue + scontrol requeue after epoch 1: resumed after epoch 1, epoch 1 not trained again ($took s)"
        else
            fail "requeue: job $job $state; expected the second attempt to resume after epoch 1"
            show "$out" 40
        fi
        if grep -Eq '^Total Epochs: 3' <<<"$second"; then
            pass "Burn's summary of the requeued run: Total Epochs: 3"
        else
            fail "requeue: Burn's summary does not say 'Total Epochs: 3'"
            grep -n 'Total Epochs' "$out" | sed 's/^/    | /'
        fi
    fi

    # 4. two jobs sharing the node, no port given. Each job's script waits (bounded) until
    # both jobs hold their CPUs, so that their ranks and stores run at the same time.
    t=$SECONDS
    mkdir -p "$WORK/pair"
    cat >"$WORK/pair.sh" <<EOF
#!/bin/bash
touch "$WORK/pair/\$SLURM_JOB_ID"
for i in \$(seq 240); do [ "\$(ls "$WORK/pair" | wc -l)" -ge 2 ] && break; sleep 0.25; done
srun --kill-on-bad-exit=1 "$BIN" --epochs 1 ${SMALL[*]} --out "$WORK/pair-\$SLURM_JOB_ID"
EOF
    a=$(sbatch --parsable -n2 -o "$WORK/pair-a.out" "$WORK/pair.sh")
    b=$(sbatch --parsable -n2 -o "$WORK/pair-b.out" "$WORK/pair.sh")
    sa=$(job_wait "$a" 300)
    sb=$(job_wait "$b" 300)
    if [ "$sa" = COMPLETED ] && [ "$sb" = COMPLETED ] && [ "$(ls "$WORK/pair" | wc -l)" = 2 ]; then
        pass "two 2-rank jobs at once on one node, no MASTER_PORT: both trained ($((SECONDS - t)) s)"
    else
        fail "two jobs at once: $a $sa, $b $sb"
        show "$WORK/pair-a.out" 10
        show "$WORK/pair-b.out" 10
    fi

    # 5. a task that never starts, under --kill-on-bad-exit=1
    t=$SECONDS
    out="$WORK/badexit.out"
    timeout 300 srun -n2 --kill-on-bad-exit=1 bash -c \
        "if [ \"\$SLURM_PROCID\" = 1 ]; then exit 127; fi; exec $BIN --epochs 1 ${SMALL[*]} --out $WORK/badexit" \
        >"$out" 2>&1
    rc=$?
    took=$((SECONDS - t))
    if [ "$rc" != 0 ] && [ "$took" -lt 60 ]; then
        pass "a task exiting 127 before it joins, srun --kill-on-bad-exit=1: the step ended in $took s (exit $rc)"
    else
        fail "a task exiting before it joins: exit $rc after $took s; expected a failure within 60 s"
        show "$out"
    fi
fi

# 6. mpirun (Open MPI) and mpiexec (MPICH's Hydra), for each classifier
for pkg in openmpi-bin:mpirun.openmpi mpich:mpiexec.mpich; do
    if ! command -v "${pkg#*:}" >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${pkg%%:*}" \
            >>"$WORK/apt-mpi.log" 2>&1 || true
    fi
done
for mpi in "Open MPI:mpirun.openmpi --allow-run-as-root --oversubscribe -np 2" \
    "MPICH:mpiexec.mpich -n 2"; do
    label=${mpi%%:*}
    read -ra cmd <<<"${mpi#*:}"
    if ! command -v "${cmd[0]}" >/dev/null 2>&1; then
        say "skipped: the $label check (${cmd[0]} is not installed and could not be installed here)"
        continue
    fi
    for bin in "${BINS[@]}"; do
        t=$SECONDS
        name=$(basename "$bin")
        out="$WORK/${cmd[0]}-$name.out"
        # Output to a file, as in a batch job: Open MPI still gives each rank a pseudo-terminal.
        timeout 300 "${cmd[@]}" "$bin" --epochs 1 "${SMALL[@]}" --out "$WORK/${cmd[0]}-$name" \
            >"$out" 2>&1
        rc=$?
        if [ "$rc" = 0 ] && [ "$(count '2 ranks ×' "$out")" = 1 ] &&
            [ "$(count 'final test accuracy' "$out")" = 1 ] && ! grep -q 'panicked' "$out"; then
            pass "$label, ${cmd[*]} $name: one job of 2 ranks, no panic ($((SECONDS - t)) s; $(count 'instead of Burn' "$out") dashboard warning)"
        else
            fail "$label, ${cmd[*]} $name (exit $rc): expected one '2 ranks' line, one final accuracy, no panic"
            show "$out"
        fi
    done
done

slurm_cluster_stop
trap - EXIT
if [ "$failures" -gt 0 ]; then
    say "$failures check(s) failed ($((SECONDS - started)) s; files in $WORK)"
    exit 1
fi
say "all checks passed in $((SECONDS - started)) s"
rm -rf "$WORK"
