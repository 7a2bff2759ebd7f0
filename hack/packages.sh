#!/usr/bin/env bash
# Installs the Debian packages the tests need and the Go builds do not give: redis-server (Argo CD's cache)
# and git (Argo CD's repo server fetches with it; `git daemon` serves the test repository and ships in the
# git package); prometheus (2.42, with promtool: the metrics e2e test scrapes the operator with it, and the
# chart's alert rules are unit-tested with `promtool test rules`). A no-op when every command is already there.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

# command | Debian package that provides it
wanted=(
  "redis-server|redis-server"
  "git|git"
  "prometheus|prometheus"
  "promtool|prometheus"
  # The operator image (hack/image.sh): podman with runc (crun fails on these hybrid cgroups), mmdebstrap for
  # its Debian 12 base, uidmap for podman without root.
  "podman|podman"
  "runc|runc"
  "mmdebstrap|mmdebstrap"
  "newuidmap|uidmap"
  # The real node (hack/real-node.sh): containerd (runc comes above), the CNI bridge and host-local plugins,
  # ipset and iptables for kube-router, socat for the forwarders to the host's loopback servers, openssl for
  # the kubelet's certificates, gcc for the static pause binary.
  "containerd|containerd"
  "/usr/lib/cni/bridge|containernetworking-plugins"
  "ipset|ipset"
  "iptables|iptables"
  "socat|socat"
  "openssl|openssl"
  "gcc|gcc"
)

missing=()
for entry in "${wanted[@]}"; do
  IFS='|' read -r command package <<<"$entry"
  command -v "$command" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null 2>&1 || { log "need root (or sudo) to install: ${missing[*]}"; exit 1; }
  sudo=(sudo)
fi
log "installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet; refresh them only when the install cannot find a package.
if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
  "${sudo[@]}" apt-get update
  "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi
