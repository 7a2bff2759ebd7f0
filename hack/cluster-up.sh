#!/usr/bin/env bash
# Starts the local test cluster on loopback: a real control plane (etcd, kube-apiserver with RBAC,
# controller-manager, scheduler) and KWOK through `kwokctl --runtime=binary`, fake g6.12xlarge GPU nodes, a
# real node (hack/real-node.sh), the real KubeRay operator out of cluster, an S3/EC2-compatible server (moto)
# and a local Ray head.
# Writes $STATE/kubeconfig and $STATE/env. Idempotent: a running cluster is left as it is.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

if "$root/hack/cluster-status.sh" >/dev/null 2>&1; then
  log "local cluster already running ($STATE/env)"
  exit 0
fi
"$root/hack/cluster-down.sh" >/dev/null 2>&1 || true # clear what a half-started cluster left

start=$(date +%s)
# What the cluster runs, and nothing else, each a no-op when cached: the Go tools and the image the real node's
# Ray pods run (hack/dlc-image.sh), side by side, as they are the two slow parts of a cold start (`make demo`
# and `make cluster-up` build both as prerequisites, beside the virtualenvs).
"$root/hack/packages.sh"
"$root/hack/build-tools.sh" --cluster &
tools=$!
dlc_image=$("$root/hack/dlc-image.sh")
wait "$tools" || { log "building the cluster's tools failed"; exit 1; }
require_free_ports "$APISERVER_PORT" "$S3_PORT" "${RAY_HEAD_PORTS[@]}" "$KUBERAY_METRICS_PORT" "$KUBERAY_HEALTH_PORT" ||
  { log "stop what holds these ports, or move ours with the variables in hack/lib.sh"; exit 1; }
rm -rf "$STATE/logs"
mkdir -p "$STATE/logs" "$STATE/pids"
trap 'status=$?; if ((status)); then log "cluster-up failed (exit $status)"; dump_logs; fi' EXIT

write_env_file
key=${dlc_image##*/dlc-standin-} && echo "export FSDP_DLC_IMAGE=localhost/fsdp-operator/dlc-standin:${key%.tar}" >>"$STATE/env"
# Start the Ray head first: it is the slowest part and needs nothing from Kubernetes.
"$root/hack/ray-head.sh" start

log "starting S3/EC2 server (moto) on 127.0.0.1:$S3_PORT"
# Where moto writes the requests it records between a test's /moto-api/recorder/start- and stop-recording.
start_daemon moto env MOTO_RECORDER_FILEPATH="$STATE/moto-recording.jsonl" \
  "$VENV/bin/moto_server" -H 127.0.0.1 -p "$S3_PORT"

log "creating control plane with kwokctl (binary runtime)"
# kwokctl gives etcd, the controller-manager, the scheduler and kwok the highest ports below 32768 that are
# free at that moment: two clusters created at once would take the same ones, so one creates at a time
# (--close: the components kwokctl starts must not inherit, and so keep, the lock).
{
  sed -e "s|@PKI@|$KWOK_WORKDIR/clusters/$CLUSTER_NAME/pki|g" -e "s|@SERVICE_CIDR@|$SERVICE_CIDR|g" \
    -e "s|@HOST_POD_ADDRESS@|$HOST_POD_ADDRESS|g" \
    "$root/hack/cluster/kwokctl.yaml"
  echo ---
  cat "$root/hack/cluster/kwok.yaml"
} >"$STATE/kwok.yaml"
flock --close /tmp/fsdp-kwokctl-create.lock kwokctl create cluster --name "$CLUSTER_NAME" --runtime binary \
  --kube-apiserver-port "$APISERVER_PORT" \
  --kube-authorization=true \
  --etcd-binary "$root/bin/etcd" \
  --kube-apiserver-binary "$root/bin/kube-apiserver" \
  --kube-controller-manager-binary "$root/bin/kube-controller-manager" \
  --kube-scheduler-binary "$root/bin/kube-scheduler" \
  --kwok-controller-binary "$root/bin/kwok" \
  --config "$STATE/kwok.yaml" --kubeconfig "$STATE/kubeconfig" \
  --kube-audit-policy "$root/hack/cluster/audit-policy.yaml" \
  --wait 5m >"$STATE/logs/kwokctl.log" 2>&1

export KUBECONFIG=$STATE/kubeconfig

log "adding fake nodes and the KubeRay CRDs"
"$root/hack/cluster/nodes.sh" | kubectl apply -f - >/dev/null
# Server-side apply: these CRDs exceed the client-side last-applied annotation limit.
kubectl apply --server-side -f "$root/bin/kuberay-crds/" >/dev/null
# The limits below are generous on purpose: a loaded 2-core machine can be several times slower than usual.
wait_for "KubeRay CRDs established" 180 kubectl wait --for condition=established --timeout 5s crd/rayclusters.ray.io crd/rayjobs.ray.io

"$root/hack/kuberay.sh" start
wait_for "S3 server" 120 curl -sf "http://127.0.0.1:$S3_PORT/moto-api/"
"$root/hack/ray-head.sh" wait
wait_for "fake nodes Ready" 180 kubectl wait --for condition=Ready --timeout 5s node -l type=kwok
FSDP_NODE_IMAGES=$dlc_image "$root/hack/real-node.sh" start
log "local cluster up in $(($(date +%s) - start))s; source $STATE/env"
