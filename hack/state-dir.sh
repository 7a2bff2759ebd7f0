#!/usr/bin/env bash
# Prints the state dir (pids, logs, kubeconfig, env file) of the local cluster FSDP_CLUSTER_INSTANCE names,
# so that the tests and benches find it by lib.sh's rule instead of a copy of it.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"
printf '%s\n' "$STATE"
