#!/usr/bin/env bash
# Slurm in a box: Debian's slurm-wlm and munge on this one machine, started for the length
# of one command and stopped after it. One node with the machine's real core count and
# memory, or with --nodes N several "nodes": a slurmd in each of N network namespaces
# (scripts/cluster.sh's recipe: veth links to a bridge, 10.79.0.1..N, the controller on
# the bridge at 10.79.0.254), each with its share of the cores and memory, so that ranks
# on different nodes talk over TCP through the bridge (MPICH's UCX is held to TCP on
# eth0 for COMMAND, as cluster.sh does).
#
#   scripts/slurm.sh [--install] [--nodes N] [--timeout SECONDS] -- COMMAND...
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
install=0 limit=900 nodes=1
while (($#)); do
  case "$1" in
    --install) install=1; shift ;;
    --nodes) nodes=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--install] [--nodes N] [--timeout SECONDS] -- COMMAND..." >&2; exit 2 ;;
  esac
done
(($#)) || { echo "error: no command to run (after --)" >&2; exit 2; }
[[ "$nodes" =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 8)) || { echo "error: --nodes $nodes: expected 1..8" >&2; exit 2; }

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
mkdir -p "$state/ctld" "$state/munge" "$state/log"
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10))
bridge=br-sbox
if ((nodes == 1)); then
  ctld_host=$host
  node_lines="NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
  node_list=$host
else
  ctld_host="$host(10.79.0.254)"
  node_lines=""
  for ((i = 0; i < nodes; i++)); do
    node_lines+="NodeName=sbox$i NodeAddr=10.79.0.$((i + 1)) NodeHostname=sbox$i CPUs=$(((cpus / nodes) > 0 ? cpus / nodes : 1)) RealMemory=$((mem_mb / nodes)) State=UNKNOWN"$'\n'
  done
  node_list=$(seq -s, -f 'sbox%g' 0 $((nodes - 1)))
fi
cat >"$state/slurm.conf" <<EOF
ClusterName=stoker-box
SlurmctldHost=$ctld_host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${STOKER_SLURMCTLD_PORT:-16817}
SlurmdPort=${STOKER_SLURMD_PORT:-16818}
AuthType=auth/munge
AuthInfo=socket=$state/munge/munge.socket.2,cred_expire=5
SchedulerParameters=sched_interval=1,bf_interval=1
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d-%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
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
$node_lines
PartitionName=box Nodes=$node_list Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
export SLURM_CONF=$state/slurm.conf

down() {
  local rc=$?
  local pids=("$state"/slurmd-*.pid "$state/slurmctld.pid" "$state/munge/munged.pid")
  for pidfile in "${pids[@]}"; do
    [ -s "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  for pidfile in "${pids[@]}"; do
    [ -s "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
  done
  if ((nodes > 1)); then
    for ((i = 0; i < nodes; i++)); do
      ip netns del "sbox$i" 2>/dev/null || true
      ip link del "vsbox$i" 2>/dev/null || true
    done
    ip link del "$bridge" 2>/dev/null || true
  fi
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
# On a cluster munged and slurmctld have a machine's cores to themselves; here they share
# two with a job's ranks, which spin in MPICH's collectives. Under that load in CI munged
# once gave up on a scancel's half-sent request, and scancel died of SIGPIPE. So the
# daemons (and the tests' clients) run ahead of the ranks: nice -5, or, where that is not
# allowed, at the usual priority (nice says so in the log).
nice -n -5 munged --force --key-file="$state/munge/munge.key" --socket="$state/munge/munge.socket.2" \
  --pid-file="$state/munge/munged.pid" --log-file="$state/log/munged.log" \
  --seed-file="$state/munge/munged.seed" 2>>"$state/log/munged.log" || {
  echo "SKIPPED: munged did not start: $(tail -n 2 "$state/log/munged.log" | tr '\n' ' ')" >&2
  exit 77
}
nice -n -5 slurmctld -i 2>>"$state/log/slurmctld.log" || { echo "SKIPPED: slurmctld did not start (see $state/log/slurmctld.log)" >&2; exit 77; }
if ((nodes == 1)); then
  mkdir -p "$state/d-$host"
  slurmd 2>>"$state/log/slurmd.log" || { echo "SKIPPED: slurmd did not start: $(tail -n 2 "$state"/log/slurmd-*.log | tr '\n' ' ')" >&2; exit 77; }
else
  # A network namespace per node; nsenter (not `ip netns exec`, which mounts a fresh
  # /sys without the cgroup file systems slurmd reads) starts its slurmd there.
  for tool in ip nsenter; do
    command -v "$tool" >/dev/null || { echo "SKIPPED: $tool not found (iproute2, util-linux)" >&2; exit 77; }
  done
  # What a killed box left behind (this box holds the lock).
  for ((i = 0; i < 8; i++)); do ip netns del "sbox$i" 2>/dev/null || true; done
  ip link del "$bridge" 2>/dev/null || true
  if ! { ip link add "$bridge" type bridge && ip netns add sbox-probe && ip netns del sbox-probe; } 2>"$state/log/netns.log"; then
    echo "SKIPPED: cannot create network namespaces or a bridge here: $(tr '\n' ' ' <"$state/log/netns.log")" >&2
    exit 77
  fi
  ip addr add 10.79.0.254/24 dev "$bridge"
  ip link set "$bridge" up
  for ((i = 0; i < nodes; i++)); do
    ip netns add "sbox$i"
    ip link add "vsbox$i" type veth peer name eth0 netns "sbox$i"
    ip link set "vsbox$i" master "$bridge" up
    ip -n "sbox$i" addr add "10.79.0.$((i + 1))/24" dev eth0
    ip -n "sbox$i" link set eth0 up
    ip -n "sbox$i" link set lo up
    mkdir -p "$state/d-sbox$i"
    nsenter --net="/var/run/netns/sbox$i" slurmd -N "sbox$i" 2>>"$state/log/slurmd.log" ||
      { echo "SKIPPED: slurmd sbox$i did not start: $(tail -n 2 "$state/log/slurmd-sbox$i.log" | tr '\n' ' ')" >&2; exit 77; }
  done
  # Ranks on different "nodes" share this machine: keep MPICH's UCX off shared memory.
  export UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 UCX_RNDV_THRESH=${UCX_RNDV_THRESH:-inf}
fi
idle() { [ "$(sinfo -h -N -o '%T' 2>/dev/null | sort -u)" = idle ]; }
for ((i = 0; i < 60; i++)); do
  idle && break
  sleep 1
done
if ! idle; then
  echo "SKIPPED: the Slurm nodes did not become idle within 60 s: $(sinfo -h -N -o '%N %T %E' 2>&1 | tr '\n' ' ')" >&2
  exit 77
fi
echo "slurm box: $nodes node(s) ($node_list) idle, SLURM_CONF=$SLURM_CONF" >&2
timeout --foreground "$limit" "$@"
