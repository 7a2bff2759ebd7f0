#!/usr/bin/env bash
# Prints lib.sh's settings named as arguments, one line each (an array's items space-separated), for the
# local cluster FSDP_CLUSTER_INSTANCE names: tests and benches find its state dir, ports and Ray temp dir by
# lib.sh's rule instead of a copy of it.   hack/settings.sh STATE RAY_HEAD_PORTS
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"
for name in "$@"; do
  declare -n setting=$name
  printf '%s\n' "${setting[*]}"
done
