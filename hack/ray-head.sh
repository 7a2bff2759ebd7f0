#!/usr/bin/env bash
# The local cluster's Ray head, on 127.0.0.1 with the ports of hack/lib.sh.
#   start    start it (and return: cluster-up starts the rest meanwhile)
#   wait     wait until its job API answers; a head that exited before that is started again, twice at most
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

start() {
  # This head serves every job of the suite: its log monitor lists the log directory ten times a second while
  # it holds under 1,000 files (about 9 % of a core here, measured with py-spy); once a second is enough to
  # forward the workers' output to their drivers.
  # Jobs inherit the head's environment: their temporary files (a killed trainer's checkpoint staging) and the
  # trainer's node cache under the head's temp dir, which cluster-down removes; the local S3 endpoint and credentials (as a node role would give
  # them), and no hub access. `ray start` turns --node-ip-address 127.0.0.1 into the host's address unless
  # Ray's single-machine switch is set (named for the platforms where it is the default); with it the node and
  # all its servers stay on loopback. RAY_ADDRESS, as KubeRay sets it in its pods: without it Ray processes
  # that look the cluster up (Ray Train's placement-group cleaner asks the state API) read
  # /tmp/ray/ray_current_cluster, which --temp-dir leaves stale or absent, and every job's end waited 12 s
  # for that lookup to time out. Token auth, as the operator sets it on every run's cluster: the dashboard and
  # GCS answer only callers with the token (its health endpoints stay open, for probes). It runs in the DLC's
  # environment (Python 3.13, the DLC's Ray and torch), first on PATH, so that jobs' `python` is the DLC's. The
  # dashboard's modules get 300 s to start, not Ray's 30: on a loaded machine MetricsHead took longer, and the
  # dashboard (the job API) exited with it. Ray Train's preemption watcher (an actor per attempt polling the
  # GCS every 5 s for drained nodes, which only an autoscaler drains) is off: one node, never drained, and it
  # cost 10 % of each attempt's CPU here (53 vs 59 CPU-s for the CPU demo, measured side by side). Its agent's
  # node statistics and its dashboard's own metrics every 60 s, not 5: nothing here reads them (with the log
  # monitor's setting, tests/support/real_node.py QUIET_RAY, which the real node's pods get too).
  log "starting Ray head (GCS :$RAY_GCS_PORT, dashboard :$RAY_DASHBOARD_PORT)"
  mkdir -p "$RAY_TMP/tmp"
  (source "$STATE/env" && export TMPDIR=$RAY_TMP/tmp FSDP_TRAINER_CACHE=$RAY_TMP/trainer-cache HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
    RAY_ADDRESS=127.0.0.1:$RAY_GCS_PORT RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$FSDP_LOCAL_RAY_TOKEN \
    AUTOSCALER_METRIC_PORT=$RAY_AUTOSCALER_METRICS_PORT DASHBOARD_METRIC_PORT=$RAY_DASHBOARD_METRICS_PORT \
    RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT=300 PATH="$DLC_VENV/bin:$PATH" \
    RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0 LOG_NAME_UPDATE_INTERVAL_S=1 RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0 \
    REPORTER_UPDATE_INTERVAL_MS=60000 METRICS_RECORD_INTERVAL_S=60 &&
    start_daemon ray "$DLC_VENV/bin/ray" start --head --block \
      --node-ip-address 127.0.0.1 --port "$RAY_GCS_PORT" --ray-client-server-port "$RAY_CLIENT_PORT" \
      --dashboard-host 127.0.0.1 --dashboard-port "$RAY_DASHBOARD_PORT" \
      --dashboard-agent-listen-port "$RAY_DASHBOARD_AGENT_PORT" \
      --dashboard-agent-grpc-port "$RAY_AGENT_GRPC_PORT" --runtime-env-agent-port "$RAY_RUNTIME_ENV_AGENT_PORT" \
      --node-manager-port "$RAY_NODE_MANAGER_PORT" --object-manager-port "$RAY_OBJECT_MANAGER_PORT" \
      --metrics-export-port "$RAY_METRICS_EXPORT_PORT" \
      --min-worker-port "$RAY_MIN_WORKER_PORT" --max-worker-port "$RAY_MAX_WORKER_PORT" \
      --num-cpus "${RAY_NUM_CPUS:-4}" --num-gpus 0 --temp-dir "$RAY_TMP" --disable-usage-stats)
}

# `ray start` gives the raylet a fixed 30 s to register with the GCS (ray/_private/node.py, not configurable)
# and exits when it has not: on a loaded 2-core machine that happened to one cluster of the suite's two, and every
# test of that worker failed. A head that exits is started again from a clean temp dir.
wait_ready() {
  local attempt deadline pid
  for attempt in 1 2 3; do
    deadline=$(($(date +%s) + 300))
    pid=$(cat "$PIDS/ray.pid")
    until ray_dashboard_answers; do
      if ! kill -0 "$pid" 2>/dev/null; then
        log "the Ray head exited before its job API answered (attempt $attempt); its last lines:"
        tail -n 5 "$STATE/logs/ray.log" >&2
        stop_leftovers
        ((attempt < 3)) && start
        continue 2
      fi
      if (($(date +%s) >= deadline)); then
        log "timed out waiting for the Ray head's job API; logs in $STATE/logs and $RAY_TMP/session_latest/logs"
        return 1
      fi
      sleep 1
    done
    return 0
  done
  log "the Ray head exited three times before answering"
  return 1
}

# stop_leftovers: Ray's processes outlive a failed `ray start --block`; they all carry our temp dir on their
# command line.
stop_leftovers() {
  local leftovers
  leftovers=$(pgrep -f -- "$RAY_TMP" || true)
  if [[ -n $leftovers ]]; then
    kill -KILL $leftovers 2>/dev/null || true
  fi
  rm -rf "$RAY_TMP"
}

case ${1:-} in
start) start ;;
wait) wait_ready ;;
stop-leftovers) stop_leftovers ;;
*)
  echo "usage: $0 start|wait|stop-leftovers" >&2
  exit 2
  ;;
esac
