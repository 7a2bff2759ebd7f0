#!/usr/bin/env bash
# The whole suite's two tiers, `make test`'s recipe: the operator's environment (Python 3.11) on WORKERS
# pytest workers, and beside it the trainer's in the DLC's (Python 3.13) on one worker of its own. Side by
# side because the operator's tier alone left the machine idle about half its time (its tests wait on clusters
# and Ray, docs/benchmarks.md "The suite's own time"), which the trainer's tier, all CPU, fills. Each tier's
# workers take cluster instances of their own (tests/support/paths.py, FSDP_TEST_FIRST_INSTANCE): the
# trainer's tier starts above the operator's, so it never finds an operator worker's cluster (and S3) running
# and loses it when that worker stops. Both run whatever the other's outcome, so that one tier's failure never hides the other's; the end
# names each tier's failures and exits non-zero if either failed.
# Usage: hack/test.sh OPERATOR_PYTHON DLC_PYTHON TRAINER_TESTS WORKERS [pytest args...]
set -uo pipefail

operator_python=$1 dlc_python=$2 trainer_tests=$3 workers=$4
shift 4
first_instance=${FSDP_TEST_FIRST_INSTANCE:-0}
summaries=$(mktemp -d)
trap 'rm -rf "$summaries"' EXIT
# Each tier in a process group of its own whose SIGINT is not ignored, as a script's background jobs' is
# without job control: an interrupt is passed on to both (below), and each pytest stops the clusters it started.
set -m

# tier NAME INSTANCE WORKERS PYTHON ARGS...: runs one tier's pytest, its output kept for the summary.
tier() {
  local name=$1 instance=$2 tier_workers=$3 python=$4
  shift 4
  FSDP_TEST_FIRST_INSTANCE=$instance "$python" -m pytest -n "$tier_workers" --dist loadfile --no-loadscope-reorder \
    "$@" >>"$summaries/$name" 2>&1
  echo $? >"$summaries/$name.rc"
}

touch "$summaries/operator" "$summaries/trainer"
tier trainer $((first_instance + workers)) 1 "$dlc_python" --durations=5 "$trainer_tests" "$@" &
trainer=$!
tier operator "$first_instance" "$workers" "$operator_python" --durations=15 --ignore="$trainer_tests" "$@" &
operator=$!
trap 'kill -INT -- "-$operator" "-$trainer" 2>/dev/null' INT TERM
# The operator's tier is shown as it runs (the longer one: CI's log follows it), the trainer's when both end.
tail -n +1 --pid="$operator" -f "$summaries/operator" &
shown=$!
for pid in "$operator" "$trainer" "$shown"; do
  while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
done
echo
echo "==================== the trainer's tier ===================="
cat "$summaries/trainer"

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
