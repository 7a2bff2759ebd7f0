#!/usr/bin/env bash
# Builds the operator image (Dockerfile.operator) with podman and prints its reference on stdout.
#
# No image registry is reachable here, so the base is made locally: mmdebstrap builds a Debian 12 (bookworm)
# minbase root filesystem with Python 3.11 from Debian's packages, and `podman import` turns it into an image,
# which the build gets as BASE. Both are cached by content, like the Go tools: the base under
# $CACHE/image/base-<key>.tar (key: the mmdebstrap command), the image under $CACHE/image/fsdp-operator-<key>.tar
# (key: the base and every file of the build context), and tagged localhost/fsdp-operator:<key> in podman's
# store. A warm run finds the tag (or loads the archive) and builds nothing.
#
# podman runs with the project's own containers.conf (hack/containers.conf: runc, no default ulimits).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"
export CONTAINERS_CONF=$root/hack/containers.conf

IMAGE_REPOSITORY=${IMAGE_REPOSITORY:-localhost/fsdp-operator}
BASE_PACKAGES=python3,python3-venv,ca-certificates
mkdir -p "$CACHE/image"

# The base: Debian 12 minbase with Python 3.11, keyed by what makes it.
base_recipe="mmdebstrap --variant=minbase --include=$BASE_PACKAGES bookworm, merged-usr hook, no docs, man pages or locales"
base_key=$(printf '%s\n' "$base_recipe" | sha256sum | cut -c1-12)
base_ref=localhost/fsdp-operator-base:$base_key
base_tar=$CACHE/image/base-$base_key.tar
if ! podman image exists "$base_ref"; then
  if [[ ! -s $base_tar ]]; then
    log "making the Debian 12 base ($base_recipe)"
    start=$(date +%s)
    debian_minbase "$BASE_PACKAGES" "$base_tar.tmp" "$CACHE/image/base.log"
    mv "$base_tar.tmp" "$base_tar"
    find "$CACHE/image" -maxdepth 1 -name 'base-*.tar' ! -name "base-$base_key.tar" -delete
    printf '%s\t%s\t%ss\t\n' "image-base" "bookworm" "$(($(date +%s) - start))" >>"$CACHE/build-times.tsv"
  fi
  podman import --quiet "$base_tar" "$base_ref" >/dev/null
fi

# The build context: only what the Dockerfile copies (no caches, no bytecode), staged so that the key is
# exactly what the build sees.
context=$(mktemp -d)
trap 'rm -rf "$context" "$context.pip.conf"' EXIT
cp "$root/Dockerfile.operator" "$root/pyproject.toml" "$root/requirements.lock" "$context/"
tar -C "$root" -cf - --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' operator trainer |
  tar -C "$context" -xf -
key=$( (
  echo "$base_key"
  cd "$context" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
) | sha256sum | cut -c1-12)
ref=$IMAGE_REPOSITORY:$key

# The wheels the build installs, fetched here by the project's pip (which knows this machine's index, proxy
# and certificates) and given to the build as its only index: the build itself needs no network. Keyed by
# the pins and the dependency list.
wheels_key=$(cat "$root/requirements.lock" "$root/pyproject.toml" | sha256sum | cut -c1-12)
wheels=$CACHE/image/wheels-$wheels_key
fetch_wheels() {
  [[ -f $wheels/.complete ]] && return
  log "fetching the operator's wheels into $wheels"
  rm -rf "$wheels" && mkdir -p "$wheels"
  "$VENV/bin/python" -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(*p["dependencies"], *p["optional-dependencies"]["operator"], sep="\n")' "$root/pyproject.toml" \
    >"$wheels/requirements.txt"
  # setuptools: the project's build backend, which pip needs in the build's isolated build environment.
  "$VENV/bin/pip" wheel --quiet --disable-pip-version-check --wheel-dir "$wheels" \
    -c "$root/requirements.lock" -r "$wheels/requirements.txt" "setuptools>=77" wheel
  find "$CACHE/image" -maxdepth 1 -name 'wheels-*' ! -name "wheels-$wheels_key" -exec rm -rf {} +
  touch "$wheels/.complete"
}
image_tar=$CACHE/image/fsdp-operator-$key.tar

if ! podman image exists "$ref"; then
  if [[ -s $image_tar ]]; then
    podman load --quiet --input "$image_tar" >/dev/null
  else
    log "building $ref from Dockerfile.operator on $base_ref"
    start=$(date +%s)
    fetch_wheels
    printf '[global]\nno-index = true\nfind-links = /wheels\n' >"$context.pip.conf"
    podman build --quiet --network none --build-arg "BASE=$base_ref" \
      -v "$wheels:/wheels:ro" -v "$context.pip.conf:/etc/pip.conf:ro" \
      -f "$context/Dockerfile.operator" -t "$ref" "$context" >/dev/null
    podman save --quiet --output "$image_tar.tmp" "$ref"
    mv "$image_tar.tmp" "$image_tar"
    size=$(podman image inspect --format '{{.Size}}' "$ref")
    printf '%s\t%s\t%ss\t%sMiB image\n' "operator-image" "$key" "$(($(date +%s) - start))" \
      "$((size / 1024 / 1024))" | tee -a "$CACHE/build-times.tsv" >&2
    # Older builds of this image are superseded: keep the cache to the current one.
    find "$CACHE/image" -maxdepth 1 -name 'fsdp-operator-*.tar' ! -name "fsdp-operator-$key.tar" -delete
    # Superseded builds (another key) and the build stage's untagged image go from podman's store too.
    podman images --format '{{.Repository}}:{{.Tag}}' | grep -E "^($IMAGE_REPOSITORY|$IMAGE_REPOSITORY-base):" |
      grep -v -e ":$key\$" -e ":$base_key\$" -e ':latest$' | xargs -r podman rmi >/dev/null 2>&1 || true
    podman image prune --force >/dev/null
  fi
fi
podman tag "$ref" "$IMAGE_REPOSITORY:latest"
echo "$ref"
