#!/usr/bin/env bash
# `make demo`: one FSDPTrainingRun end to end. On the local cluster (the default) the operator submits the
# trainer to the local Ray head, which trains a tiny Qwen2 on CPU with checkpoints in the local S3. With
# KUBECONFIG pointing at another cluster, that cluster is used: it needs KubeRay, and FSDP_DEMO_STORAGE set to
# an s3:// prefix the Ray pods can write; the operator then reaches the dashboard through the apiserver proxy.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"
PY=$VENV/bin/python
NAMESPACE=${FSDP_DEMO_NAMESPACE:-fsdp-demo}
RUN=tiny-demo-$(date +%m%d-%H%M%S) # a new run each time: an old run's checkpoints are never touched
TIMEOUT=${FSDP_DEMO_TIMEOUT:-900}

if [[ -n ${KUBECONFIG:-} && $KUBECONFIG != "$STATE/kubeconfig" ]]; then
  : "${FSDP_DEMO_STORAGE:?set FSDP_DEMO_STORAGE=s3://bucket/prefix to run the demo on your cluster}"
  log "using the cluster in KUBECONFIG=$KUBECONFIG"
  storage=$FSDP_DEMO_STORAGE
  operator_env=(FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE=service-proxy)
else
  "$root/hack/cluster-up.sh"
  source "$STATE/env"
  storage=s3://fsdp-demo/runs
  # Pods under KWOK run nothing: jobs go to the local Ray head, which trains on CPU.
  operator_env=(FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE=override "FSDP_OPERATOR_DASHBOARD_URL=$RAY_DASHBOARD_URL"
    "FSDP_OPERATOR_DASHBOARD_TOKEN=$FSDP_LOCAL_RAY_TOKEN"
    FSDP_OPERATOR_TRAINER_DEVICE=cpu "FSDP_OPERATOR_AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL")
  log "uploading the demo corpus to s3://fsdp-demo/data/"
  "$PY" - <<'EOF'
import boto3
s3 = boto3.client("s3")
if "fsdp-demo" not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
    s3.create_bucket(Bucket="fsdp-demo", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
s3.upload_file("examples/data/stdlib-docstrings.jsonl", "fsdp-demo", "data/stdlib-docstrings.jsonl")
EOF
fi

log "installing the FSDPTrainingRun CRD"
kubectl apply --server-side --force-conflicts -f "$root/crds" >/dev/null
wait_for "CRD established" 60 kubectl wait --for condition=established --timeout 5s \
  crd/fsdptrainingruns.fsdp.training.dev
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f - >/dev/null

log "starting the operator (log: $STATE/logs/demo-operator.log)"
env "${operator_env[@]}" FSDP_OPERATOR_WATCH_NAMESPACES="$NAMESPACE" FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS=5 \
  FSDP_OPERATOR_HEALTH_PORT=0 \
  PYTHONPATH="$root/operator:$root/trainer" "$PY" -m fsdp_operator >"$STATE/logs/demo-operator.log" 2>&1 &
operator_pid=$!
trap 'kill "$operator_pid" 2>/dev/null; wait "$operator_pid" 2>/dev/null || true' EXIT

log "applying examples/cpu-demo.yaml as $NAMESPACE/$RUN"
sed -e "s/^  name: tiny-demo$/  name: $RUN/" -e "s|s3://fsdp-demo/runs|$storage|" "$root/examples/cpu-demo.yaml" |
  kubectl apply -n "$NAMESPACE" -f -

deadline=$(($(date +%s) + TIMEOUT))
last=""
kubectl get trainingruns -n "$NAMESPACE" "$RUN" | sed -n 1p # reads all: `head` could end kubectl with SIGPIPE
while true; do
  row=$(kubectl get trainingruns -n "$NAMESPACE" "$RUN" --no-headers)
  [[ $row != "$last" ]] && echo "$row" && last=$row
  phase=$(kubectl get trainingruns -n "$NAMESPACE" "$RUN" -o jsonpath='{.status.phase}')
  [[ $phase == Succeeded || $phase == Failed ]] && break
  if (($(date +%s) > deadline)); then
    log "the run did not finish within ${TIMEOUT}s; operator log: $STATE/logs/demo-operator.log"
    exit 1
  fi
  sleep 3
done

echo
kubectl get trainingruns -n "$NAMESPACE" "$RUN" -o wide
echo
kubectl get trainingruns -n "$NAMESPACE" "$RUN" -o json | "$PY" -c '
import json, sys
status = json.load(sys.stdin)["status"]
print("phase:            ", status["phase"], "-", status.get("message", ""))
print("image requested:  ", status["image"].get("requested"))
print("image digest ran: ", status["image"].get("digest"))
print("trainer sha256:   ", status["record"].get("packageSha256"))
print("versions:         ", status["record"].get("versions"))
print("transport:        ", (status.get("transport") or {}).get("observed"))
p = status.get("progress", {})
print("progress:          step %s/%s loss %s eval loss %s tokens/s %s" % (
    p.get("step"), p.get("maxSteps"), p.get("loss"), p.get("evalLoss"), p.get("tokensPerSecond")))
print("checkpoints:")
for c in status.get("checkpoints", {}).get("recent", []):
    print("   step %5d  %s  %s" % (c["step"], c["time"], c["uri"]))
print("restarts:          %d" % status.get("restarts", {}).get("count", 0))
for r in status.get("restarts", {}).get("history", []):
    print("   %s  %s  resumed from step %s  %s" % (r["time"], r["reason"], r.get("resumedFromStep"), r.get("message", "")))
print("exported model:   ", status["record"].get("exportedModelUri"))
print("run record:       ", status["record"].get("uri"))
'
[[ $(kubectl get trainingruns -n "$NAMESPACE" "$RUN" -o jsonpath='{.status.phase}') == Succeeded ]]
