#!/usr/bin/env bash
# Slurm in a box: Debian's slurm-wlm and munge on this one machine (one node with its real
# core count and memory), started for the length of one command and stopped after it.
#
#   scripts/slurm.sh [--install] [--timeout SECONDS] -- COMMAND...
#
# --install installs the packages (slurmctld slurmd slurm-client munge) where missing.
# The daemons run from a private state directory with their own slurm.conf (SLURM_CONF is
# exported to COMMAND), so the machine's /etc/slurm is neither read nor written. MpiDefault
# is pmi2: `srun -n N stoker train ...` starts N ranks that MPICH wires up through Slurm's
# PMI server (Debian's MPICH speaks the PMI-1 wire protocol, which that plugin serves).
# Everything is stopped on exit (trap), including after the timeout (default 900 s).
# Exit status 77 means Slurm cannot run here (not installed, or the daemons did not come
# up within a minute): the caller reports a skip, naming the log that says why.
set -euo pipefail
install=0 limit=900
while (($#)); do
  case "$1" in
    --install) install=1; shift ;;
    --timeout) limit=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--install] [--timeout SECONDS] -- COMMAND..." >&2; exit 2 ;;
  esac
done
(($#)) || { echo "error: no command to run (after --)" >&2; exit 2; }

if ((install)); then
  missing=()
  for pkg in slurmctld slurmd slurm-client munge; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
for tool in slurmctld slurmd srun sbatch sinfo munged; do
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || {
    echo "SKIPPED: $tool not found (scripts/slurm.sh --install installs Debian's slurm-wlm and munge)" >&2
    exit 77
  }
done
export PATH="$PATH:/usr/sbin"

# One box at a time: the daemons listen on fixed ports.
exec 9>/run/stoker-slurm.lock
flock -w "$limit" 9 || { echo "error: another Slurm box holds /run/stoker-slurm.lock" >&2; exit 1; }

state=$(mktemp -d /tmp/stoker-slurm.XXXXXX)
chmod 755 "$state"
mkdir -p "$state/ctld" "$state/d" "$state/munge" "$state/log"
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10))
cat >"$state/slurm.conf" <<EOF
ClusterName=stoker-box
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${STOKER_SLURMCTLD_PORT:-16817}
SlurmdPort=${STOKER_SLURMD_PORT:-16818}
AuthType=auth/munge
AuthInfo=socket=$state/munge/munge.socket.2,cred_expire=5
SchedulerParameters=sched_interval=1,bf_interval=1
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
Waittime=0
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=box Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
export SLURM_CONF=$state/slurm.conf

down() {
  local rc=$?
  for pidfile in "$state/slurmd.pid" "$state/slurmctld.pid" "$state/munge/munged.pid"; do
    [ -s "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  for pidfile in "$state/slurmd.pid" "$state/slurmctld.pid" "$state/munge/munged.pid"; do
    [ -s "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
  done
  if ((rc != 0)) && [ -z "${STOKER_SLURM_KEEP:-}" ]; then
    echo "slurm box logs ($state/log), last lines:" >&2
    tail -n 5 "$state"/log/*.log >&2 2>/dev/null || true
  fi
  [ -n "${STOKER_SLURM_KEEP:-}" ] || rm -rf "$state"
  exit "$rc"
}
trap down EXIT
trap 'exit 143' TERM INT

# munge: a key of our own, its socket in the state directory.
dd if=/dev/urandom of="$state/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$state/munge/munge.key"
munged --force --key-file="$state/munge/munge.key" --socket="$state/munge/munge.socket.2" \
  --pid-file="$state/munge/munged.pid" --log-file="$state/log/munged.log" \
  --seed-file="$state/munge/munged.seed" 2>>"$state/log/munged.log" || {
  echo "SKIPPED: munged did not start: $(tail -n 2 "$state/log/munged.log" | tr '\n' ' ')" >&2
  exit 77
}
slurmctld -i 2>>"$state/log/slurmctld.log" || { echo "SKIPPED: slurmctld did not start (see $state/log/slurmctld.log)" >&2; exit 77; }
slurmd 2>>"$state/log/slurmd.log" || { echo "SKIPPED: slurmd did not start (see $state/log/slurmd.log)" >&2; exit 77; }
for ((i = 0; i < 60; i++)); do
  if sinfo -h -N -o '%T' 2>/dev/null | grep -qx idle; then
    break
  fi
  sleep 1
done
if ! sinfo -h -N -o '%T' 2>/dev/null | grep -qx idle; then
  echo "SKIPPED: the Slurm node did not become idle within 60 s: $(sinfo -h -N -o '%N %T %E' 2>&1 | tr '\n' ' ')" >&2
  exit 77
fi
echo "slurm box: node $host ($cpus CPUs) idle, SLURM_CONF=$SLURM_CONF" >&2
timeout --foreground "$limit" "$@"
