#!/usr/bin/env bash
# Creates or updates the project's virtualenv (outside the repo, shared by clones) from requirements.lock.
# A no-op when the lock has not changed since the last install.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

want=$(sha256sum "$root/requirements.lock" | cut -c1-16)
if [[ -x $VENV/bin/python && $(cat "$VENV/.lock-sha256" 2>/dev/null) == "$want" ]]; then
  exit 0
fi
start=$(date +%s)
log "installing Python dependencies into $VENV (requirements.lock $want)"
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$root/requirements.lock"
echo "$want" >"$VENV/.lock-sha256"
log "Python dependencies installed in $(($(date +%s) - start))s"
