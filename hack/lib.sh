# Shared settings and helpers for the hack/ scripts; sourced, never run. Every port is on 127.0.0.1 and
# can be moved with the environment variable of the same name. They lie below Linux's ephemeral range
# (32768-60999): a port in it can be taken by any outgoing connection while its server is down, and a test
# that stops KubeRay for three minutes then could not start it again on its port.
# shellcheck shell=bash
CACHE=${FSDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fsdp-operator} # builds, kept between clones
VENV=${FSDP_VENV:-$CACHE/venv}
# The DLC's environment (hack/dlc/requirements.lock, Python 3.13): the local Ray head and the trainer's tests
# run in it, as the trainer runs in the Ray Train DLC in production.
DLC_VENV=${FSDP_DLC_VENV:-$CACHE/dlc-venv}
MLFLOW_VENV=${FSDP_MLFLOW_VENV:-$CACHE/mlflow-venv}
# The Go tools the local cluster runs (hack/build-tools.sh --cluster); `make tools` also builds Kueue, Argo CD
# and helm for the tests.
CLUSTER_TOOLS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kwokctl ray-operator kubelet
  coredns kube-router)
# FSDP_CLUSTER_INSTANCE=N runs another cluster beside the first from the same checkout (the suite's second
# pytest worker uses 1): its own state dir, Ray temp dir and cluster name, and every port moved up by N x 1000.
INSTANCE=${FSDP_CLUSTER_INSTANCE:-0}
if ((INSTANCE == 0)); then instance_suffix=""; else instance_suffix="-$INSTANCE"; fi
port_offset=$((INSTANCE * 1000))
STATE=${FSDP_STATE_DIR:-$root/.local-cluster$instance_suffix} # pids, logs, kubeconfig, env file of the cluster
# Ray puts unix sockets under its temp dir; keep the path short (108-byte limit) and unique per checkout and
# instance (equal-length hashes: no instance's path is a prefix of another's, which pgrep -f relies on).
RAY_TMP=${FSDP_RAY_TMP:-/tmp/fsdp-ray-$(printf '%s%s' "$root" "$instance_suffix" | sha1sum | cut -c1-8)}
CLUSTER_NAME=${CLUSTER_NAME:-fsdp-local$instance_suffix}
APISERVER_PORT=${APISERVER_PORT:-$((26443 + port_offset))}
S3_PORT=${S3_PORT:-$((26900 + port_offset))}
RAY_GCS_PORT=${RAY_GCS_PORT:-$((26379 + port_offset))}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-$((26265 + port_offset))}
RAY_CLIENT_PORT=${RAY_CLIENT_PORT:-$((26001 + port_offset))}
# Ray's default agent port, 52365, would be shared by two heads. Every other port of the head is fixed too:
# two heads starting at once each picked their own free ports and both took 10005 (one died at start).
RAY_DASHBOARD_AGENT_PORT=${RAY_DASHBOARD_AGENT_PORT:-$((26365 + port_offset))}
RAY_NODE_MANAGER_PORT=${RAY_NODE_MANAGER_PORT:-$((26366 + port_offset))}
RAY_OBJECT_MANAGER_PORT=${RAY_OBJECT_MANAGER_PORT:-$((26367 + port_offset))}
RAY_METRICS_EXPORT_PORT=${RAY_METRICS_EXPORT_PORT:-$((26368 + port_offset))}
RAY_AGENT_GRPC_PORT=${RAY_AGENT_GRPC_PORT:-$((26369 + port_offset))}
RAY_RUNTIME_ENV_AGENT_PORT=${RAY_RUNTIME_ENV_AGENT_PORT:-$((26370 + port_offset))}
# The autoscaler monitor's and the dashboard's own Prometheus endpoints: Ray's defaults are fixed (44217, 44227).
RAY_AUTOSCALER_METRICS_PORT=${RAY_AUTOSCALER_METRICS_PORT:-$((26371 + port_offset))}
RAY_DASHBOARD_METRICS_PORT=${RAY_DASHBOARD_METRICS_PORT:-$((26372 + port_offset))}
RAY_MIN_WORKER_PORT=$((20000 + port_offset)) # workers' ports: 1000 per instance, below the other ports
RAY_MAX_WORKER_PORT=$((20999 + port_offset))
RAY_HEAD_PORTS=("$RAY_GCS_PORT" "$RAY_DASHBOARD_PORT" "$RAY_CLIENT_PORT" "$RAY_DASHBOARD_AGENT_PORT"
  "$RAY_NODE_MANAGER_PORT" "$RAY_OBJECT_MANAGER_PORT" "$RAY_METRICS_EXPORT_PORT" "$RAY_AGENT_GRPC_PORT"
  "$RAY_RUNTIME_ENV_AGENT_PORT" "$RAY_AUTOSCALER_METRICS_PORT" "$RAY_DASHBOARD_METRICS_PORT")
KUBERAY_METRICS_PORT=${KUBERAY_METRICS_PORT:-$((26080 + port_offset))}
KUBERAY_HEALTH_PORT=${KUBERAY_HEALTH_PORT:-$((26081 + port_offset))}
export KWOK_WORKDIR=$STATE/kwok
# The real node (hack/real-node.sh): a kubelet and containerd in network and mount namespaces of their own, on
# a segment of 198.18.0.0/15 (RFC 2544's benchmarking range) per instance that nothing routes out of: the
# host's end of it .1 (where pods reach S3 and the apiserver, forwarded to loopback), the node .2, pods
# .10-.250. Services get 198.19.N.0/24 (no kube-proxy: only headless Services answer, through cluster DNS).
REAL_NODE_NAME=real-0
POD_NET_PREFIX=198.18.$INSTANCE
HOST_POD_ADDRESS=$POD_NET_PREFIX.1
NODE_IP=$POD_NET_PREFIX.2
SERVICE_CIDR=198.19.$INSTANCE.0/24
NODE_DIR=$STATE/node
# The node's containerd root (its images, unpacked) is kept between clusters and clones, one per instance.
# hack/real-node.sh removes every container from it on stop, and starts from an empty root after a stop that
# did not. An empty root, or one holding other images, is hard-linked from NODE_IMAGE_ROOTS: the images every
# node starts with (the DLC stand-in, 2.4 GB, minutes of CPU to import), unpacked once per machine into a
# containerd root of their own, keyed by the images' content.
NODE_CONTAINERD_ROOT=$CACHE/real-node$instance_suffix/containerd
NODE_IMAGE_ROOTS=$CACHE/real-node-images
HOST_LINK=fsdpnode$INSTANCE # the host's end of the veth pair into the node's network namespace
NODE_CGROUP=fsdp-node-$INSTANCE # the kubelet's cgroupRoot, in every cgroup hierarchy
# Its CPU weight: as much under contention as four busy host processes (each of which weighs 1024 beside it).
# At the default, one process's worth, a loaded host leaves all the node's pods a tenth of a CPU, and Ray's
# head dies starting (its client server gives the raylet 30 s to register, a bound Ray does not expose).
NODE_CPU_SHARES=4096
# Its allocatable ephemeral-storage: an EKS node's on the default 20 GiB root volume (hack/real-node.sh).
NODE_ALLOCATABLE_DISK=$((17 * 1024 ** 3))
NODE_DISK_EVICTION_PERCENT=5 # hack/node/kubelet.yaml's nodefs.available
# Only pods that tolerate it run on the real node: the KWOK-node tests' runs, which train on the shared Ray
# head, must never start real containers (nor count the node's fake GPUs in preflight).
REAL_NODE_TAINT=fsdp.training.dev/real-node=true:NoSchedule
# kwokctl writes the apiserver's audit log here (hack/cluster/audit-policy.yaml), rotated at 50 MB, 2 kept.
APISERVER_AUDIT_LOG=$KWOK_WORKDIR/clusters/$CLUSTER_NAME/logs/audit.log
export PATH="$root/bin:$VENV/bin:$PATH"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# start_daemon NAME CMD...: runs CMD in a session of its own (pid = process group id), logs to
# $STATE/logs/NAME.log and records the pid in $PIDS/NAME.pid ($STATE/pids: cluster-down stops them).
PIDS=$STATE/pids
start_daemon() {
  local name=$1
  shift
  setsid "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$PIDS/$name.pid"
}

# debian_minbase PACKAGES TAR LOG: a Debian 12 minbase root filesystem with the packages (comma-separated), as a
# tarball for `podman import`; exits printing the log's tail when mmdebstrap fails. No docs, man pages or
# locales. --skip=output/dev: no device nodes in the tarball (podman provides /dev), so no root is needed for
# them; the merged-usr hook merges /usr itself, without the usrmerge package (and the perl it needs).
debian_minbase() {
  mmdebstrap --quiet --format=tar --variant=minbase --include="$1" --skip=output/dev \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' bookworm "$2" \
    >"$3" 2>&1 || { tail -n 30 "$3" >&2; exit 1; }
}

# wait_for WHAT SECONDS CMD...: retries CMD once a second until it succeeds or the time is up.
wait_for() {
  local what=$1 deadline=$(($(date +%s) + $2))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if (($(date +%s) >= deadline)); then
      log "timed out waiting for $what (ran: $*); logs in $STATE/logs"
      return 1
    fi
    sleep 1
  done
}

# require_free_ports PORT...: fails naming each port that something already listens on, and what it is.
require_free_ports() {
  local port busy=0
  for port in "$@"; do
    if ss -Hltn "sport = :$port" | grep -q .; then
      log "port 127.0.0.1:$port is already in use: $(ss -Hltnp "sport = :$port" | sed -n 1p)"
      busy=1
    fi
  done
  return $busy
}

# dump_logs: the last lines of every daemon log, so that a failed start explains itself wherever it ran.
dump_logs() {
  local file
  for file in "$KWOK_WORKDIR/clusters/$CLUSTER_NAME"/logs/*.log "$RAY_TMP"/session_latest/logs/dashboard.log \
    "$STATE"/logs/*.log; do
    [[ -e $file && $file != "${APISERVER_AUDIT_LOG%.log}"* ]] || continue
    printf -- '--- last lines of %s ---\n' "$file" >&2
    tail -n 20 "$file" >&2
  done
}

# ray_dashboard_answers: the local Ray head's job API answers a caller with its token.
ray_dashboard_answers() {
  curl -sf -H "X-Ray-Authorization: Bearer $(sed -n 's/^export FSDP_LOCAL_RAY_TOKEN=//p' "$STATE/env")" \
    "http://127.0.0.1:$RAY_DASHBOARD_PORT/api/version" >/dev/null
}

write_env_file() {
  local ray_token
  ray_token=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
  cat >"$STATE/env" <<ENV
export KUBECONFIG=$STATE/kubeconfig
export AWS_ENDPOINT_URL=http://127.0.0.1:$S3_PORT
export AWS_ACCESS_KEY_ID=testing
export AWS_SECRET_ACCESS_KEY=testing
export AWS_DEFAULT_REGION=us-west-2
export RAY_DASHBOARD_URL=http://127.0.0.1:$RAY_DASHBOARD_PORT
export RAY_GCS_ADDRESS=127.0.0.1:$RAY_GCS_PORT
export FSDP_LOCAL_RAY_TOKEN=$ray_token
export FSDP_LOCAL_CLUSTER_STATE=$STATE
export APISERVER_AUDIT_LOG=$APISERVER_AUDIT_LOG
export FSDP_REAL_NODE=$REAL_NODE_NAME
export FSDP_HOST_POD_ADDRESS=$HOST_POD_ADDRESS
export FSDP_POD_S3_ENDPOINT=http://$HOST_POD_ADDRESS:$S3_PORT
export FSDP_POD_APISERVER_PORT=$APISERVER_PORT
ENV
}
