#!/usr/bin/env bash
# Creates or updates the project's virtualenvs named as arguments (operator, dlc, mlflow; all three when none is
# named), outside the repo and shared by clones, each a no-op when its lock has not changed since the last install.
# `make` runs the three side by side (each pip is single-threaded):
# - the operator's (Python 3.11): requirements.lock;
# - the DLC's (Python 3.13, the Ray Train DLC's interpreter; pyenv's on these machines, or FSDP_PYTHON313):
#   hack/dlc/requirements.lock and the test tools, for the local Ray head and the trainer's tests;
# - the MLflow tracking server's (Python 3.11): hack/mlflow/requirements.lock, for the tracking tests and
#   bench/trainer_mlflow.py (mlflow pins pyarrow below the operator's 26.0.1, so it cannot share that venv).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

# install VENV PYTHON LOCK...: the venv from PYTHON with exactly the locks' pins.
install() {
  local venv=$1 python=$2 want start
  shift 2
  want=$(cat "$@" | sha256sum | cut -c1-16)
  if [[ -x $venv/bin/python && $(cat "$venv/.lock-sha256" 2>/dev/null) == "$want" ]]; then
    return 0
  fi
  start=$(date +%s)
  log "installing Python dependencies into $venv (${*#"$root/"} $want)"
  [[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
  local requirements=()
  for lock in "$@"; do requirements+=(-r "$lock"); done
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${requirements[@]}"
  echo "$want" >"$venv/.lock-sha256"
  log "Python dependencies installed in $venv in $(($(date +%s) - start))s"
}

python313() {
  local found
  if [[ -n ${FSDP_PYTHON313:-} ]]; then
    echo "$FSDP_PYTHON313"
    return
  fi
  found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13.*/bin/python3.13 2>/dev/null | sort -V | tail -n 1)
  if [[ -z $found ]]; then
    log "Python 3.13 not found: the DLC's environment needs it. These machines' image has it from pyenv" \
      "(${PYENV_ROOT:-$HOME/.pyenv}/versions/3.13.*); elsewhere install it or set FSDP_PYTHON313=/path/to/python3.13"
    exit 1
  fi
  echo "$found"
}

names=("$@")
((${#names[@]})) || names=(operator dlc mlflow)
for which in "${names[@]}"; do
  case $which in
    operator) install "$VENV" python3 "$root/requirements.lock" ;;
    dlc) install "$DLC_VENV" "$(python313)" "$root/hack/dlc/requirements.lock" "$root/hack/dlc/test-requirements.txt" ;;
    mlflow) install "$MLFLOW_VENV" python3 "$root/hack/mlflow/requirements.lock" ;;
    *) log "unknown virtualenv '$which': operator, dlc or mlflow" && exit 2 ;;
  esac
done
