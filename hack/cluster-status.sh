#!/usr/bin/env bash
# Exits 0 when the local cluster from cluster-up is running and answering; prints what is not.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

ok=0
for name in ray moto kuberay; do
  if ! kill -0 "$(cat "$STATE/pids/$name.pid" 2>/dev/null)" 2>/dev/null; then
    echo "$name: not running"
    ok=1
  fi
done
for name in namespaces containerd kubelet coredns kube-router; do # the real node's (hack/real-node.sh)
  if ! kill -0 "$(cat "$NODE_DIR/pids/$name.pid" 2>/dev/null)" 2>/dev/null; then
    echo "real node's $name: not running"
    ok=1
  fi
done
if ! KUBECONFIG=$STATE/kubeconfig kubectl get --raw /readyz >/dev/null 2>&1; then
  echo "kube-apiserver: not ready"
  ok=1
fi
if ! ray_dashboard_answers; then
  echo "ray dashboard: not answering"
  ok=1
fi
exit $ok
