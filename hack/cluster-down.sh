#!/usr/bin/env bash
# Stops everything cluster-up started, by pid: the real node, the daemons' process groups, then the kwokctl cluster (which
# stops its own etcd, apiserver, controller-manager, scheduler and kwok by their pid files), then any Ray
# process still running from this checkout's Ray temp dir. Leaves no process of ours behind.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

stop_group() { # pid file
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null
  fi
  rm -f "$1"
}

"$root/hack/real-node.sh" stop # first: its kubelet must not see the apiserver go
for pidfile in "$STATE"/pids/*.pid; do
  [[ -e $pidfile ]] && stop_group "$pidfile"
done
if [[ -d $KWOK_WORKDIR/clusters/$CLUSTER_NAME ]]; then
  kwokctl delete cluster --name "$CLUSTER_NAME" >/dev/null 2>&1 || true
fi
# Ray's raylet and workers can outlive `ray start --block`.
"$root/hack/ray-head.sh" stop-leftovers
log "local cluster stopped"
