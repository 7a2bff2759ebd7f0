#!/usr/bin/env bash
# Builds the DLC stand-in image (hack/dlc/Containerfile) with podman, offline, and prints the path of its OCI
# archive on stdout (the real node imports it into containerd). Cached by content under $CACHE/image: the key
# covers the base recipe, the Containerfile, the lock and the interpreter's build, so nothing is rebuilt
# unless one of them changes. The image is named localhost/fsdp-operator/dlc-standin:<key>.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"
export CONTAINERS_CONF=$root/hack/containers.conf

# Debian 12 minbase with what the DLC image has that Ray, KubeRay and pyenv's Python 3.13 need.
BASE_PACKAGES=ca-certificates,wget,procps,libbz2-1.0,libexpat1,libffi8,libgdbm6,liblzma5,libncursesw6,libreadline8,libsqlite3-0,libssl3,libtinfo6,libuuid1,zlib1g
python_home=$(cd "$(dirname "$(readlink -f "$DLC_VENV/bin/python")")/.." && pwd)
[[ -x $python_home/bin/python3.13 ]] || { log "no Python 3.13 at $python_home: run make venv"; exit 1; }
mkdir -p "$CACHE/image"

base_recipe="mmdebstrap --variant=minbase --include=$BASE_PACKAGES bookworm, merged-usr hook, no docs, man pages or locales"
base_key=$(printf '%s\n' "$base_recipe" | sha256sum | cut -c1-12)
base_ref=localhost/fsdp-operator/dlc-base:$base_key
key=$( (
  echo "$base_key"
  sha256sum "$root/hack/dlc/Containerfile" "$root/hack/dlc/entrypoint.sh" "$root/hack/dlc/requirements.lock" \
    "$root/hack/dlc/stage_venv.py" |
    cut -d' ' -f1
  sha256sum "$python_home/bin/python3.13" "$python_home/lib/libpython3.13.so.1.0" | cut -d' ' -f1
) | sha256sum | cut -c1-12)
ref=localhost/fsdp-operator/dlc-standin:$key
archive=$CACHE/image/dlc-standin-$key.tar
exec 9>"$CACHE/image/dlc-image.lock"
flock 9 # one build at a time: two clusters starting at once wait for the same image
if [[ -s $archive ]]; then
  echo "$archive"
  exit 0
fi

start=$(date +%s)
if ! podman image exists "$base_ref"; then
  log "making the DLC stand-in's Debian 12 base ($base_recipe)"
  base_tar=$(mktemp --suffix .tar)
  debian_minbase "$BASE_PACKAGES" "$base_tar" "$CACHE/image/dlc-base.log"
  podman import --quiet "$base_tar" "$base_ref" >/dev/null
  rm -f "$base_tar"
fi

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
mkdir "$context/python"
cp -a "$python_home/bin" "$python_home/lib" "$python_home/include" "$context/python/"
rm -rf "$context/python/lib/python3.13/site-packages"/* "$context/python/lib/python3.13/test"
find "$context/python" -name __pycache__ -prune -exec rm -rf {} +
cp "$root/hack/dlc/Containerfile" "$root/hack/dlc/entrypoint.sh" "$context/"
# /opt/venv from the host's DLC venv (make venv-dlc installed exactly the lock there), hard-linked, not the
# lock's wheels installed a second time: pip's unpacking and byte-compiling of 4.6 GB was most of the build.
"$DLC_VENV/bin/python" "$root/hack/dlc/stage_venv.py" "$root/hack/dlc/requirements.lock" "$context/venv"
log "building $ref (the DLC stand-in) on $base_ref"
podman build --quiet --network none --build-arg "BASE=$base_ref" \
  -f "$context/Containerfile" -t "$ref" "$context" >/dev/null
podman save --quiet --format oci-archive --output "$archive.tmp" "$ref"
mv "$archive.tmp" "$archive"
size=$(podman image inspect --format '{{.Size}}' "$ref")
printf '%s\t%s\t%ss\t%sMiB image\n' "dlc-standin-image" "$key" "$(($(date +%s) - start))" \
  "$((size / 1024 / 1024))" | tee -a "$CACHE/build-times.tsv" >&2
# Superseded builds go, from the cache and from podman's store (the archive is what the node imports), and the
# lock's wheels that builds before stage_venv.py installed from (4 GB).
find "$CACHE/image" -maxdepth 1 -name 'dlc-standin-*.tar' ! -name "dlc-standin-$key.tar" -delete
rm -rf "$CACHE/image"/dlc-wheels-*
podman rmi "$ref" >/dev/null 2>&1 || true
podman image prune --force >/dev/null
echo "$archive"
