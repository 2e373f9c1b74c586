#!/usr/bin/env bash
# The launcher scripts/cluster.sh gives MPICH's Hydra in place of ssh: Hydra calls it as
# ssh, `cluster-exec.sh [-x] HOST COMMAND` (the command one string, as ssh passes it to the
# remote shell), and it runs COMMAND in network namespace HOST with its own host name.
set -euo pipefail
while [[ "${1:-}" == -* ]]; do shift; done
host=$1
shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"
