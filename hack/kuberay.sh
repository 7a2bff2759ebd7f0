#!/usr/bin/env bash
# The local cluster's KubeRay operator, run out of cluster against the local apiserver.
#   start [FLAGS...]   start it (with these flags of KubeRay's too) and wait until it is healthy
#   kill     SIGKILL it, as when its pod dies (RayClusters stay as they are; nothing reconciles them)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

case ${1:-} in
start)
  log "starting the KubeRay operator out of cluster"
  start_daemon kuberay "$root/bin/ray-operator" --kubeconfig "$STATE/kubeconfig" \
    --enable-leader-election=false --metrics-addr "127.0.0.1:$KUBERAY_METRICS_PORT" \
    --health-probe-bind-address "127.0.0.1:$KUBERAY_HEALTH_PORT" "${@:2}"
  # Generous: a loaded 2-core machine can be several times slower than usual.
  wait_for "KubeRay operator" 180 curl -sf "http://127.0.0.1:$KUBERAY_HEALTH_PORT/healthz"
  ;;
kill)
  kill -KILL -- "-$(cat "$STATE/pids/kuberay.pid")"
  wait_for "the old KubeRay operator's ports to be free" 60 require_free_ports "$KUBERAY_METRICS_PORT" \
    "$KUBERAY_HEALTH_PORT"
  ;;
*)
  echo "usage: $0 start|kill" >&2
  exit 2
  ;;
esac
