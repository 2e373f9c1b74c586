#!/usr/bin/env bash
# A cluster in a box: each rank in its own network namespace (its own "node"), joined by
# veth links through a bridge whose links are shaped with tc (bandwidth, latency), and
# MPICH launched across them so that rank-to-rank traffic really crosses the shaped links.
#
#   scripts/cluster.sh [-n RANKS] [--rate RATE] [--queue LATENCY] [--delay DELAY] [--timeout SECONDS] -- COMMAND...
#
# RATE is tc's (10gbit, 1gbit, 100mbit; default 1gbit; `none`: veth links unshaped), DELAY netem's one-way delay per link
# (default none, e.g. 0.5ms), LATENCY the longest a packet may wait in a link's shaping
# queue (tbf's `latency`, default 100ms). Every link is shaped in both directions, so a message between
# two ranks crosses two shaped hops, one per "node" NIC, as on a switched network. MPICH's UCX
# transport is held to TCP over the namespace's eth0 (no shared memory between "nodes").
# Everything is removed on exit (trap), including after a timeout (default 600 s); runs are
# serialized by a lock. Exit status 77 means namespaces cannot be made here (no CAP_NET_ADMIN,
# no veth or bridge support): the caller reports a skip.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ranks=2 rate=1gbit delay="" limit=600 queue=${STOKER_CLUSTER_QUEUE:-100ms}
while (($#)); do
  case "$1" in
    -n) ranks=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --queue) queue=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-n RANKS] [--rate RATE] [--queue LATENCY] [--delay DELAY] [--timeout S] -- COMMAND..." >&2; exit 2 ;;
  esac
done
(($#)) || { echo "error: no command to run (after --)" >&2; exit 2; }
[[ "$ranks" =~ ^[0-9]+$ ]] && ((ranks >= 1 && ranks <= 32)) || { echo "error: -n $ranks: expected 1..32 ranks" >&2; exit 2; }
for tool in ip tc unshare mpiexec; do
  command -v "$tool" >/dev/null || { echo "SKIPPED: $tool not found (scripts/install-deps.sh installs it)" >&2; exit 77; }
done

exec 9>/run/stoker-cluster.lock
flock -w "$limit" 9 || { echo "error: another cluster run holds /run/stoker-cluster.lock" >&2; exit 1; }

bridge=br-stoker
down() {
  for ((i = 0; i < ranks; i++)); do
    ip netns del "stoker$i" 2>/dev/null || true
    ip link del "vstoker$i" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
}
trap down EXIT
down
if ! { ip link add "$bridge" type bridge && ip netns add stoker-probe && ip netns del stoker-probe; } 2>/tmp/stoker-cluster.err; then
  echo "SKIPPED: cannot create network namespaces or a bridge here: $(tr '\n' ' ' </tmp/stoker-cluster.err)" >&2
  exit 77
fi
if [ -n "$delay" ] && ! tc qdisc add dev "$bridge" root netem delay "$delay" 2>/dev/null; then
  echo "error: --delay needs tc's netem qdisc (kernel module sch_netem), which this kernel lacks; bandwidth shaping (tbf) works without it" >&2
  exit 1
fi
tc qdisc del dev "$bridge" root 2>/dev/null || true
ip addr add 10.77.0.254/24 dev "$bridge"
ip link set "$bridge" up
shape() { # shape NETNS-ARGS DEV
  local ns=("${@:1:$#-1}") dev=${!#}
  [ "$rate" = none ] && return 0
  if [ -n "$delay" ]; then
    ip "${ns[@]}" link set "$dev" txqueuelen 10000
    tc "${ns[@]}" qdisc add dev "$dev" root handle 1: netem delay "$delay" limit 100000
    tc "${ns[@]}" qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" burst 256kb latency "$queue"
  else
    tc "${ns[@]}" qdisc add dev "$dev" root tbf rate "$rate" burst 256kb latency "$queue"
  fi
}
hosts=()
for ((i = 0; i < ranks; i++)); do
  ns=stoker$i
  ip netns add "$ns"
  ip link add "v$ns" type veth peer name eth0 netns "$ns"
  ip link set "v$ns" master "$bridge" up
  ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  shape "v$ns"             # bridge -> rank i
  shape -n "$ns" eth0      # rank i -> bridge
  hosts+=("$ns")
done
echo "cluster: $ranks ranks in namespaces ${hosts[*]}, links $rate${delay:+ + ${delay} delay} each way" >&2
hostlist=$(IFS=,; echo "${hosts[*]}")
# Every message goes eagerly: UCX's rendezvous over TCP needs the receiving rank inside an
# MPI call to move data, and stoker's ranks compute between their collectives, so a
# collective waited for the other rank's next call (the 8-block GPT, unshaped: ZeRO-3 waited
# 54-66 ms of each step at UCX's default threshold, 20-21 ms at 1 MiB; DDP at 100 Mbit/s
# 656-700 ms at 1 MiB, 519 ms, its bytes' link time, at 8 MiB or above; docs/distributed.md).
# UCX_RNDV_THRESH in the caller's environment wins.
timeout -k 10 "$limit" mpiexec -launcher ssh -launcher-exec "$here/cluster-exec.sh" \
  -hosts "$hostlist" -iface "$bridge" -n "$ranks" -ppn 1 \
  -genv UCX_TLS tcp,self -genv UCX_NET_DEVICES eth0 -genv UCX_RNDV_THRESH "${UCX_RNDV_THRESH:-inf}" "$@"
