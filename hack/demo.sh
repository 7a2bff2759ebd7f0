#!/usr/bin/env bash
# `make demo`: one FSDPTrainingRun end to end. On the local cluster (the default) it runs on real pods: the
# operator (out of cluster, as a platform team's would be outside a GPU cluster's nodes) reaches the run's Ray
# head through the apiserver's service proxy; KubeRay starts the head and two workers on the real node in the
# DLC stand-in image; they train a tiny Qwen2 on CPU with checkpoints in the local S3. With KUBECONFIG
# pointing at another cluster, that cluster is used: it needs KubeRay, and FSDP_DEMO_STORAGE set to an s3://
# prefix the Ray pods can write, and FSDP_DEMO_APISERVER_CIDRS the apiserver's addresses (each run's
# NetworkPolicy admits them to its dashboard).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"
PY=$VENV/bin/python
NAMESPACE=${FSDP_DEMO_NAMESPACE:-fsdp-demo}
RUN=tiny-demo-$(date +%m%d-%H%M%S) # a new run each time: an old run's checkpoints are never touched
TIMEOUT=${FSDP_DEMO_TIMEOUT:-900}
example=$root/examples/cpu-demo-real-pods.yaml

# The operator runs without leader election here: one replica, on a machine that may be loaded, must not exit
# because a lease renewal was answered late.
# The price of the demo's instance type (us-west-2 on demand), so that the run shows what it would cost.
operator_env=(FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE=service-proxy FSDP_OPERATOR_LEADER_ELECTION=false
  'FSDP_OPERATOR_INSTANCE_HOUR_PRICES={"g6.12xlarge": 4.6016}')
if [[ -n ${KUBECONFIG:-} && $KUBECONFIG != "$STATE/kubeconfig" ]]; then
  : "${FSDP_DEMO_STORAGE:?set FSDP_DEMO_STORAGE=s3://bucket/prefix to run the demo on your cluster}"
  : "${FSDP_DEMO_APISERVER_CIDRS:?set FSDP_DEMO_APISERVER_CIDRS to the address ranges of the apiserver}"
  log "using the cluster in KUBECONFIG=$KUBECONFIG"
  storage=$FSDP_DEMO_STORAGE
  example=$root/examples/cpu-demo.yaml
  operator_env+=("FSDP_OPERATOR_DASHBOARD_INGRESS_CIDRS=$FSDP_DEMO_APISERVER_CIDRS")
else
  "$root/hack/cluster-up.sh"
  source "$STATE/env"
  storage=s3://fsdp-demo/runs
  # The apiserver's proxied connections reach pods from the host's end of the pod segment; the Ray pods reach
  # S3 there too, with the local server's credentials, and no model hub.
  pod_env=$(printf '{"AWS_ENDPOINT_URL": "%s", "AWS_ACCESS_KEY_ID": "%s", "AWS_SECRET_ACCESS_KEY": "%s", "AWS_DEFAULT_REGION": "%s", "HF_HUB_OFFLINE": "1", "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "300"}' \
    "$FSDP_POD_S3_ENDPOINT" "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" "$AWS_DEFAULT_REGION")
  operator_env+=("FSDP_OPERATOR_DASHBOARD_INGRESS_CIDRS=$FSDP_HOST_POD_ADDRESS/32"
    "FSDP_OPERATOR_DEFAULT_IMAGE=$FSDP_DLC_IMAGE" FSDP_OPERATOR_RAY_IMAGE_PULL_POLICY=IfNotPresent "FSDP_OPERATOR_RAY_POD_ENV=$pod_env"
    FSDP_OPERATOR_TRAINER_DEVICE=cpu "FSDP_OPERATOR_AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL")
  log "uploading the demo corpus to s3://fsdp-demo/data/"
  "$PY" - <<'EOF2'
import boto3
s3 = boto3.client("s3")
if "fsdp-demo" not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
    s3.create_bucket(Bucket="fsdp-demo", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
s3.upload_file("examples/data/stdlib-docstrings.jsonl", "fsdp-demo", "data/stdlib-docstrings.jsonl")
EOF2
fi

log "installing the FSDPTrainingRun CRD"
kubectl apply --server-side --force-conflicts -f "$root/crds" >/dev/null
wait_for "CRD established" 60 kubectl wait --for condition=established --timeout 5s \
  crd/fsdptrainingruns.fsdp.training.dev
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
# The platform's grant (docs/security.md): the demo's runs may tolerate the real node's taint.
kubectl annotate namespace "$NAMESPACE" --overwrite \
  'fsdp.training.dev/run-tolerations=[{"key": "fsdp.training.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}]' >/dev/null

# The platform's S3 grant: the run writes under the demo's storage and reads the demo corpus.
operator_env+=("FSDP_OPERATOR_S3_PREFIXES=$storage/,s3://fsdp-demo/data/")

log "starting the operator (log: $STATE/logs/demo-operator.log)"
env "${operator_env[@]}" FSDP_OPERATOR_WATCH_NAMESPACES="$NAMESPACE" FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS=5 \
  FSDP_OPERATOR_HEALTH_PORT=0 \
  PYTHONPATH="$root/operator:$root/trainer" "$PY" -m fsdp_operator >"$STATE/logs/demo-operator.log" 2>&1 &
operator_pid=$!
trap 'kill "$operator_pid" 2>/dev/null; wait "$operator_pid" 2>/dev/null || true' EXIT

log "applying examples/$(basename "$example") as $NAMESPACE/$RUN"
sed -e "s/^  name: tiny-demo$/  name: $RUN/" -e "s|s3://fsdp-demo/runs|$storage|" "$example" |
  kubectl apply -n "$NAMESPACE" -f -

deadline=$(($(date +%s) + TIMEOUT))
last="" last_pods=""
kubectl get trainingruns -n "$NAMESPACE" "$RUN" | sed -n 1p # reads all: `head` could end kubectl with SIGPIPE
while true; do
  row=$(kubectl get trainingruns -n "$NAMESPACE" "$RUN" --no-headers)
  # A row when the run changes, not when only its AGE (the last column) does.
  [[ ${row% *} != "${last% *}" ]] && echo "$row" && last=$row
  pods=$(kubectl get pods -n "$NAMESPACE" -l "fsdp.training.dev/run=$RUN" --no-headers \
    -o custom-columns='POD:.metadata.name,NODE:.spec.nodeName,CONTAINER:.status.containerStatuses[0].containerID' 2>/dev/null || true)
  if [[ $pods != "$last_pods" && -n $pods ]]; then
    sed 's/^/    pod /' <<<"$pods"
    last_pods=$pods
  fi
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
# The plugin's summary (installed as `kubectl trainingrun`; here from the source tree), then rank 0's log tail.
plugin=(env PYTHONPATH="$root/kubectl_trainingrun:$root/fsdp_client:$root/operator:$root/trainer" "$PY" -m kubectl_trainingrun)
"${plugin[@]}" describe -n "$NAMESPACE" "$RUN"
echo
log "the last lines of rank 0's log, from S3 (kubectl trainingrun logs -n $NAMESPACE $RUN)"
"${plugin[@]}" logs -n "$NAMESPACE" "$RUN" | tail -n 5
[[ $(kubectl get trainingruns -n "$NAMESPACE" "$RUN" -o jsonpath='{.status.phase}') == Succeeded ]]
