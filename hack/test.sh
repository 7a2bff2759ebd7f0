#!/usr/bin/env bash
# The whole suite's two tiers, `make test`'s recipe: the operator's environment (Python 3.11), then the
# trainer's in the DLC's (Python 3.13). Both run whatever the first one's outcome, so that one tier's failure
# never hides the other's; the end names each tier's failures and exits non-zero if either failed.
# Usage: hack/test.sh OPERATOR_PYTHON DLC_PYTHON TRAINER_TESTS WORKERS [pytest args...]
set -uo pipefail

operator_python=$1 dlc_python=$2 trainer_tests=$3 workers=$4
shift 4
summaries=$(mktemp -d)
trap 'rm -rf "$summaries"' EXIT

# tier NAME PYTHON ARGS...: runs one tier's pytest, its output shown as it comes and kept for the summary.
tier() {
  local name=$1 python=$2
  shift 2
  "$python" -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@" 2>&1 | tee "$summaries/$name"
  local rc=${PIPESTATUS[0]}
  echo "$rc" >"$summaries/$name.rc"
}

tier operator "$operator_python" --durations=15 --ignore="$trainer_tests" "$@"
tier trainer "$dlc_python" --durations=5 "$trainer_tests" "$@"

failed=0
echo
echo "==================== make test: both tiers ===================="
for name in operator trainer; do
  rc=$(cat "$summaries/$name.rc")
  # pytest's last line: "N passed, M failed ... in T s" (or why it did not run).
  echo "$name tier: exit $rc: $(grep -E '^=+ .* in [0-9.]+s' "$summaries/$name" | tail -n 1 | tr -d '=' | xargs)"
  if ((rc != 0)); then
    failed=1
    grep -E '^(FAILED|ERROR) ' "$summaries/$name" | sed 's/^/  /' || echo "  (no test failed: pytest exited $rc)"
  fi
done
exit "$failed"
