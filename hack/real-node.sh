#!/usr/bin/env bash
# The local cluster's real node, beside the KWOK nodes: a kubelet (v1.35.4, built from the module proxy) with
# Debian's containerd, runc and CNI bridge plugin, cluster DNS (CoreDNS, six plugins) and NetworkPolicy
# enforcement (kube-router, firewall only), all out of cluster.
#   start    join the node to the running control plane and wait until it is Ready
#   stop     stop it and everything it ran, and leave the host as it was found
#
# The node lives in a network namespace and a mount namespace of its own, both held by one `sleep` process:
# - network: a bridge with the node's address and the pods' veths, joined to the host by one veth pair whose
#   host end has HOST_POD_ADDRESS (lib.sh). The kubelet's and kube-router's iptables chains are the
#   namespace's, so the host's tables are never touched, and two instances' kube-routers (which delete chains
#   they do not know) never see each other's. No route leads out: a pod's connect elsewhere fails at once.
# - mount (private propagation): /run, /var/lib and /var/log are tmpfs there (containerd's shim sockets, the
#   CNI cache, container log links), three /proc/sys files show the values the kubelet insists on (it would
#   otherwise set vm.overcommit_memory, kernel.panic and kernel.panic_on_oops host-wide), and every volume and
#   rootfs mount the node makes stays inside and goes with it.
# Pods reach the host only at HOST_POD_ADDRESS, where socat forwards the apiserver's and S3's ports to their
# loopback listeners, and port 443 (TLS, AWS STS's regional name in cluster DNS) to the local STS. What stays on
# the host while the node runs: that veth end, the forwarders, and the kubelet's cgroups (NODE_CGROUP in each
# hierarchy); stop removes all three.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"
PIDS=$NODE_DIR/pids # not $STATE/pids: the node is stopped in its own order, before the control plane
PKI=$KWOK_WORKDIR/clusters/$CLUSTER_NAME/pki
PAUSE_IMAGE=localhost/fsdp-operator/pause:3.10
REGION=us-west-2 # the node's region (its labels), and so the regional AWS STS name its pods meet
KUBELET_PORT=10250 # inside the node's network namespace: no clash between instances
CNI_BIN=/usr/lib/cni
CGROUP_HIERARCHIES=(cpu cpuacct cpuset memory devices freezer blkio pids systemd)
# Where a pull of a public image would go: a refused port, so an image not imported never comes from the internet.
REGISTRIES=(docker.io registry-1.docker.io public.ecr.aws ghcr.io quay.io registry.k8s.io gcr.io nvcr.io)

holder_pid() { cat "$PIDS/namespaces.pid" 2>/dev/null; }
in_node() { nsenter --target "$(holder_pid)" --net --mount -- "$@"; }
node_ctr() { ctr --address "$NODE_DIR/containerd.sock" --namespace k8s.io "$@"; }
images_ctr() { ctr --address "$NODE_DIR/containerd-images.sock" --namespace k8s.io "$@"; }

cgroup_v2() { [[ $(stat -fc %T /sys/fs/cgroup) == cgroup2fs ]]; }
cgroup_dirs() { # the node's cgroup root in every hierarchy this host mounts
  if cgroup_v2; then
    echo "/sys/fs/cgroup/$NODE_CGROUP"
  else
    local hierarchy
    for hierarchy in "${CGROUP_HIERARCHIES[@]}" unified; do
      [[ -d /sys/fs/cgroup/$hierarchy ]] && echo "/sys/fs/cgroup/$hierarchy/$NODE_CGROUP"
    done
  fi
  return 0
}

render() { # TEMPLATE DEST: the template with this instance's values
  sed -e "s|@NODE_DIR@|$NODE_DIR|g" -e "s|@NODE_IP@|$NODE_IP|g" -e "s|@HOST_POD_ADDRESS@|$HOST_POD_ADDRESS|g" \
    -e "s|@POD_NET_PREFIX@|$POD_NET_PREFIX|g" -e "s|@NODE_CGROUP@|$NODE_CGROUP|g" \
    -e "s|@KUBELET_PORT@|$KUBELET_PORT|g" -e "s|@PAUSE_IMAGE@|$PAUSE_IMAGE|g" -e "s|@CNI_BIN@|$CNI_BIN|g" \
    -e "s|@SERVICE_CIDR@|$SERVICE_CIDR|g" -e "s|@CONTAINERD_ROOT@|$NODE_CONTAINERD_ROOT|g" \
    -e "s|@DISK_RESERVED@|${NODE_DISK_RESERVED:-0}|g" -e "s|@IMAGES_ROOT@|${IMAGES_ROOT:-}|g" \
    -e "s|@REGION@|$REGION|g" \
    "$root/hack/node/$1" >"$2"
}

# A kubeconfig for the node's processes: they reach the apiserver through the forwarder on the host's end of
# the segment, and check its certificate against the name the local kubeconfig uses (127.0.0.1).
node_kubeconfig() { # DEST [CERT KEY]: the admin identity, or the given client certificate
  cp "$STATE/kubeconfig" "$1"
  local cluster
  cluster=$(kubectl --kubeconfig "$1" config view -o jsonpath='{.clusters[0].name}')
  kubectl --kubeconfig "$1" config set-cluster "$cluster" --server "https://$HOST_POD_ADDRESS:$APISERVER_PORT" \
    --tls-server-name 127.0.0.1 >/dev/null
  if (($# == 3)); then
    local user
    user=$(kubectl --kubeconfig "$1" config view -o jsonpath='{.users[0].name}')
    kubectl --kubeconfig "$1" config set-credentials "$user" --client-certificate "$2" --client-key "$3" \
      --embed-certs >/dev/null
  fi
}

node_certificates() { # the kubelet's client (Node authorizer identity) and serving certificates, from kwokctl's CA
  local dir=$NODE_DIR/kubelet/pki name
  mkdir -p "$dir"
  cp "$PKI/ca.crt" "$dir/ca.crt"
  for name in client serving; do
    openssl ecparam -name prime256v1 -genkey -noout -out "$dir/$name.key" 2>/dev/null
    openssl req -new -key "$dir/$name.key" -subj "/O=system:nodes/CN=system:node:$REAL_NODE_NAME" \
      -out "$dir/$name.csr" 2>/dev/null
  done
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' \
    >"$dir/client.ext"
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:%s,DNS:%s\n' \
    "$NODE_IP" "$REAL_NODE_NAME" >"$dir/serving.ext"
  for name in client serving; do
    openssl x509 -req -in "$dir/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial -days 30 \
      -extfile "$dir/$name.ext" -out "$dir/$name.crt" 2>/dev/null
  done
}

# The serving certificate of AWS STS's regional name (the Corefile's), from kwokctl's CA: pods trust it through
# the CA file Kubernetes mounts with their service-account token, when their environment names it (SSL_CERT_FILE
# for pyarrow's AWS SDK, AWS_CA_BUNDLE for botocore); nothing in the images trusts it.
sts_certificate() {
  local dir=$NODE_DIR/sts name=sts.$REGION.amazonaws.com
  mkdir -p "$dir"
  openssl ecparam -name prime256v1 -genkey -noout -out "$dir/tls.key" 2>/dev/null
  openssl req -new -key "$dir/tls.key" -subj "/CN=$name" -out "$dir/tls.csr" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:%s\n' \
    "$name" >"$dir/tls.ext"
  openssl x509 -req -in "$dir/tls.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial -days 30 \
    -extfile "$dir/tls.ext" -out "$dir/tls.crt" 2>/dev/null
}

# The pause image (the pod sandbox): Kubernetes' own pause.c, from the kubelet's module, built static.
pause_image_archive() {
  local source key archive build
  source=$(cd "$root/hack/go/kubelet" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c
  key=$(sha256sum "$source" | cut -c1-12)
  archive=$CACHE/image/pause-$key.tar
  if [[ ! -s $archive ]]; then
    log "building the pause image from $source"
    build=$(mktemp -d)
    gcc -Os -static -DVERSION=v3.10-fsdp -o "$build/pause" "$source"
    strip "$build/pause"
    printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' >"$build/Containerfile"
    CONTAINERS_CONF=$root/hack/containers.conf podman build --quiet -t "$PAUSE_IMAGE" "$build" >/dev/null
    mkdir -p "$CACHE/image"
    CONTAINERS_CONF=$root/hack/containers.conf podman save --quiet --format oci-archive -o "$archive.tmp" \
      "$PAUSE_IMAGE"
    mv "$archive.tmp" "$archive"
    rm -rf "$build"
  fi
  echo "$archive"
}

# images_of ARCHIVE...: a key of what the OCI archives hold (their index.json: each image's name and manifest
# digest), then each image's name, a line each. tarfile seeks past the layers: no 2.4 GB read for a key.
images_of() {
  python3 - "$@" <<'PY'
import hashlib, json, sys, tarfile
indexes = []
for path in sys.argv[1:]:
    with tarfile.open(path) as archive:
        indexes.append(archive.extractfile("index.json").read())
print(hashlib.sha256(b"\n".join(indexes)).hexdigest()[:16])
for index in indexes:
    print(json.loads(index)["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])
PY
}

# unpack_images DIR ARCHIVE...: the archives imported into DIR/root by a containerd of their own (no CRI, no
# container, in a mount namespace of its own for the layers' mounts), their names in DIR/images last.
unpack_images() {
  local dir=$1 images_root=$1.tmp/root pid archive
  shift
  log "unpacking the node's images into $dir (once per machine: the nodes' roots are hard-linked from it)"
  rm -rf "$dir.tmp"
  mkdir -p "$images_root" "$NODE_DIR/containerd-images"
  IMAGES_ROOT=$images_root render containerd-images.toml "$NODE_DIR/containerd-images/config.toml"
  unshare --mount --propagation private -- containerd --config "$NODE_DIR/containerd-images/config.toml" \
    >"$STATE/logs/containerd-images.log" 2>&1 </dev/null &
  pid=$!
  trap 'stop_pid '"$pid" EXIT
  wait_for "the images' containerd" 60 images_ctr version
  for archive in "$@"; do
    images_ctr images import "$archive" >/dev/null
  done
  stop_pid "$pid"
  trap - EXIT
  images_of "$@" | tail -n +2 >"$dir.tmp/images"
  mv "$dir.tmp" "$dir"
  # Sets of earlier builds go (as hack/dlc-image.sh's archives do); roots linked from them keep their files.
  find "$NODE_IMAGE_ROOTS" -mindepth 1 -maxdepth 1 -type d ! -name "${dir##*/}" -exec rm -rf {} +
}

# link_node_images ARCHIVE...: the node's root from the machine's unpacked images (made first if the machine
# lacks them), unless it was made from those already: the content blobs and unpacked layers hard-linked (each
# written once, then only read: containers write into snapshots of their own), the rest copied (the bolt
# databases containerd writes in place, its server's uuid).
ROOT_IMAGES=$NODE_CONTAINERD_ROOT.images # the key of the images the root was linked from
link_node_images() {
  local key dir
  key=$(images_of "$@") # not `| head -1`: python would die of SIGPIPE, and pipefail fail the start
  key=${key%%$'\n'*}
  dir=$NODE_IMAGE_ROOTS/$key
  [[ -d $NODE_CONTAINERD_ROOT && $(cat "$ROOT_IMAGES" 2>/dev/null) == "$key" ]] && return 0
  mkdir -p "$NODE_IMAGE_ROOTS" "$(dirname "$NODE_CONTAINERD_ROOT")"
  (
    flock 8 # one unpacking per machine: nodes starting at once wait for the same one
    [[ -e $dir/images ]] || unpack_images "$dir" "$@"
    rm -rf "$NODE_CONTAINERD_ROOT" "$ROOT_IMAGES"
    cp -al "$dir/root" "$NODE_CONTAINERD_ROOT"
    (cd "$dir/root" && find . -type f ! -path './io.containerd.content.v1.content/blobs/*' \
      ! -path './io.containerd.snapshotter.v1.overlayfs/snapshots/*') | while read -r file; do
      cp --remove-destination "$dir/root/$file" "$NODE_CONTAINERD_ROOT/$file"
    done
    echo "$key" >"$ROOT_IMAGES"
    log "the node's containerd root linked from $dir"
  ) 8>"$NODE_IMAGE_ROOTS/lock"
}

# The kept root (lib.sh NODE_CONTAINERD_ROOT) serves one node at a time (the lock, held by the node's
# containerd while it runs), and only with no containers in it: the stop that emptied it leaves the marker.
# Without the marker (a node killed, not stopped) the node starts from an empty root.
ROOT_LOCK=$NODE_CONTAINERD_ROOT.lock
ROOT_EMPTIED=$NODE_CONTAINERD_ROOT.no-containers
prepare_containerd_root() {
  mkdir -p "$(dirname "$NODE_CONTAINERD_ROOT")"
  if ! flock --nonblock "$ROOT_LOCK" true; then
    log "$NODE_CONTAINERD_ROOT is in use by another real node of instance $INSTANCE (another checkout's" \
      "cluster?): stop that one, or use FSDP_CLUSTER_INSTANCE or FSDP_CACHE_DIR to keep them apart"
    exit 1
  fi
  if [[ -d $NODE_CONTAINERD_ROOT && ! -e $ROOT_EMPTIED ]]; then
    log "the kept containerd root was not emptied by a stop: starting from an empty one"
    rm -rf "$NODE_CONTAINERD_ROOT"
  fi
  rm -f "$ROOT_EMPTIED"
}

# empty_containerd_root: every container and its task out of the running containerd (the kubelet stopped).
empty_containerd_root() {
  local id
  node_ctr version >/dev/null 2>&1 || return 0
  for id in $(node_ctr containers ls -q); do
    node_ctr tasks delete --force "$id" >/dev/null 2>&1 || true
    node_ctr containers delete "$id" >/dev/null 2>&1 || true
  done
  [[ -z $(node_ctr containers ls -q) ]] && touch "$ROOT_EMPTIED"
  return 0
}

start() {
  if [[ -n $(holder_pid) ]] && kill -0 "$(holder_pid)" 2>/dev/null; then
    log "the real node is already running"
    return 0
  fi
  case $NODE_DIR/ in /run/* | /var/lib/* | /var/log/*)
    log "NODE_DIR=$NODE_DIR lies under a path the node's mount namespace hides; move the checkout or FSDP_STATE_DIR"
    exit 1 ;;
  esac
  case $NODE_CONTAINERD_ROOT/ in /run/* | /var/lib/* | /var/log/*)
    log "$NODE_CONTAINERD_ROOT lies under a path the node's mount namespace hides; set FSDP_CACHE_DIR elsewhere"
    exit 1 ;;
  esac
  local command
  for command in kubelet coredns kube-router containerd containerd-shim-runc-v2 runc ctr socat ipset iptables \
    openssl gcc nsenter unshare "$CNI_BIN/bridge" "$CNI_BIN/host-local" "$CNI_BIN/loopback"; do
    command -v "$command" >/dev/null || { log "missing $command: run make tools"; exit 1; }
  done
  log "starting the real node $REAL_NODE_NAME ($NODE_IP; pods $POD_NET_PREFIX.0/24)"
  mkdir -p "$PIDS" "$STATE/logs" "$NODE_DIR"/{containerd,cni/net.d,cni/ipam,coredns,kube-router,sysctl}
  mkdir -p "$NODE_DIR"/kubelet/{root,pod-logs,volume-plugins}
  rm -rf "$NODE_DIR/cni/ipam" && mkdir -p "$NODE_DIR/cni/ipam" # addresses of pods of an earlier node

  # The namespaces, then the segment between host and node.
  start_daemon node-namespaces unshare --net --mount --propagation private -- sleep infinity
  mv "$PIDS/node-namespaces.pid" "$PIDS/namespaces.pid"
  wait_for "the node's namespaces" 10 bash -c \
    "[[ \$(readlink /proc/$(holder_pid)/ns/net) != \$(readlink /proc/self/ns/net) ]]"
  ip link add "$HOST_LINK" type veth peer name uplink netns "$(holder_pid)"
  ip addr add "$HOST_POD_ADDRESS/24" dev "$HOST_LINK"
  ip link set "$HOST_LINK" up
  in_node ip link set lo up
  in_node ip link add br0 type bridge
  in_node ip link set uplink master br0
  in_node ip addr add "$NODE_IP/24" dev br0
  in_node ip link set br0 up
  in_node ip link set uplink up

  # The node's private mounts. The host's own values are recorded, for the test that they stay.
  printf 'vm/overcommit_memory=%s kernel/panic=%s kernel/panic_on_oops=%s\n' "$(cat /proc/sys/vm/overcommit_memory)" \
    "$(cat /proc/sys/kernel/panic)" "$(cat /proc/sys/kernel/panic_on_oops)" >"$NODE_DIR/host-sysctls"
  echo 1 >"$NODE_DIR/sysctl/overcommit_memory"
  echo 10 >"$NODE_DIR/sysctl/panic"
  echo 1 >"$NODE_DIR/sysctl/panic_on_oops"
  in_node sh -ec "
    for dir in /run /var/lib /var/log; do mount -t tmpfs -o mode=755 tmpfs \$dir; done
    mount --bind $NODE_DIR/sysctl/overcommit_memory /proc/sys/vm/overcommit_memory
    mount --bind $NODE_DIR/sysctl/panic /proc/sys/kernel/panic
    mount --bind $NODE_DIR/sysctl/panic_on_oops /proc/sys/kernel/panic_on_oops"

  # The kubelet's cgroup root, in every hierarchy it asks for.
  local dir
  while read -r dir; do
    mkdir -p "$dir"
    if [[ $dir == */cpuset/* ]]; then
      cat /sys/fs/cgroup/cpuset/cpuset.cpus >"$dir/cpuset.cpus"
      cat /sys/fs/cgroup/cpuset/cpuset.mems >"$dir/cpuset.mems"
    fi
    if [[ -f $dir/cpu.shares ]]; then
      echo "$NODE_CPU_SHARES" >"$dir/cpu.shares"
    elif [[ -f $dir/cpu.weight ]]; then # cgroup v2: weight 100 is the default, as 1024 shares are in v1
      echo $((NODE_CPU_SHARES * 100 / 1024)) >"$dir/cpu.weight"
    fi
  done < <(cgroup_dirs)

  # The forwarders pods and the node's processes reach the host's loopback servers through.
  local port
  for port in "$APISERVER_PORT" "$S3_PORT"; do
    start_daemon "forward-$port" socat "TCP-LISTEN:$port,bind=$HOST_POD_ADDRESS,fork,reuseaddr" \
      "TCP:127.0.0.1:$port"
  done
  # AWS STS at its real name, on HTTPS's port as the pods' SDKs ask for it, to the local STS (moto, S3's port).
  sts_certificate
  start_daemon forward-sts socat \
    "OPENSSL-LISTEN:443,bind=$HOST_POD_ADDRESS,cert=$NODE_DIR/sts/tls.crt,key=$NODE_DIR/sts/tls.key,verify=0,fork,reuseaddr" \
    "TCP:127.0.0.1:$S3_PORT"

  # containerd, with the pause image and the images pods run imported (no registry is reachable).
  render containerd.toml "$NODE_DIR/containerd/config.toml"
  render cni.conflist "$NODE_DIR/cni/net.d/10-fsdp.conflist"
  local registry
  for registry in "${REGISTRIES[@]}"; do
    mkdir -p "$NODE_DIR/containerd/certs.d/$registry"
    cp "$root/hack/node/registry-hosts.toml" "$NODE_DIR/containerd/certs.d/$registry/hosts.toml"
  done
  prepare_containerd_root
  local archives wanted
  archives=("$(pause_image_archive)" ${FSDP_NODE_IMAGES:-}) # FSDP_NODE_IMAGES: archives' paths, space-separated
  link_node_images "${archives[@]}"
  wanted=$(images_of "${archives[@]}" | tail -n +2)
  start_daemon containerd nsenter --target "$(holder_pid)" --net --mount -- \
    flock --nonblock "$ROOT_LOCK" containerd --config "$NODE_DIR/containerd/config.toml"
  wait_for "containerd" 60 node_ctr version
  # Images of earlier builds that tests imported (the kept root would grow with each); containerd collects
  # their content.
  local image
  for image in $(node_ctr images ls -q | grep -E '^localhost/fsdp-operator[^@]*:[^@:]+$' | grep -vxF "$wanted"); do
    node_ctr images rm "$image" >/dev/null
  done

  # The kubelet.
  node_certificates
  node_kubeconfig "$NODE_DIR/kubelet/kubeconfig" "$NODE_DIR/kubelet/pki/client.crt" "$NODE_DIR/kubelet/pki/client.key"
  node_kubeconfig "$NODE_DIR/admin.kubeconfig"
  # Allocatable ephemeral-storage of an EKS node on a 20 GiB root volume (about 17 GiB), whatever this host's
  # disk: a worker asking for more is really unschedulable here, as it would be there.
  local disk
  disk=$(df -B1 --output=size "$NODE_DIR" | tail -1)
  NODE_DISK_RESERVED=$((disk - disk * NODE_DISK_EVICTION_PERCENT / 100 - NODE_ALLOCATABLE_DISK))
  ((NODE_DISK_RESERVED > 0)) || NODE_DISK_RESERVED=0
  render kubelet.yaml "$NODE_DIR/kubelet/config.yaml"
  echo "nameserver $NODE_IP" >"$NODE_DIR/kubelet/resolv.conf"
  start_daemon kubelet nsenter --target "$(holder_pid)" --net --mount -- \
    kubelet --config="$NODE_DIR/kubelet/config.yaml" --kubeconfig="$NODE_DIR/kubelet/kubeconfig" \
    --root-dir="$NODE_DIR/kubelet/root" --cert-dir="$NODE_DIR/kubelet/pki" \
    --hostname-override="$REAL_NODE_NAME" --node-ip="$NODE_IP" \
    --node-labels="type=real,node.kubernetes.io/instance-type=g6.12xlarge,topology.kubernetes.io/region=us-west-2,topology.kubernetes.io/zone=us-west-2c,eks.amazonaws.com/nodegroup=real" \
    --register-with-taints="$REAL_NODE_TAINT" --v=1

  # Cluster DNS, in the node's namespaces.
  render Corefile "$NODE_DIR/coredns/Corefile"
  start_daemon coredns nsenter --target "$(holder_pid)" --net --mount -- \
    coredns -conf "$NODE_DIR/coredns/Corefile"
  wait_for "node $REAL_NODE_NAME Ready" 180 kubectl wait --for condition=Ready --timeout 5s "node/$REAL_NODE_NAME"
  # NetworkPolicy enforcement, once the node exists (kube-router exits when it cannot find its node).
  start_daemon kube-router nsenter --target "$(holder_pid)" --net --mount -- \
    kube-router --kubeconfig="$NODE_DIR/admin.kubeconfig" --hostname-override="$REAL_NODE_NAME" \
    --run-firewall=true --run-router=false --run-service-proxy=false --run-loadbalancer=false \
    --enable-cni=false --enable-pod-egress=false --enable-ipv4=true --enable-ipv6=false \
    --health-port=0 --metrics-port=0 --service-cluster-ip-range="$SERVICE_CIDR" --iptables-sync-period=1m

  wait_for "kube-router's NetworkPolicy chains" 60 in_node iptables -n -L KUBE-ROUTER-FORWARD
  # Fake accelerators, as the device plugins would advertise them: accounting only, no device is given. Two
  # g6.12xlarge workers' worth, so that a whole GPU-shaped RayCluster fits on this one node.
  kubectl patch node "$REAL_NODE_NAME" --subresource status --type merge \
    -p '{"status":{"capacity":{"nvidia.com/gpu":"8","vpc.amazonaws.com/efa":"2"}}}' >/dev/null
  # The kubelet derives allocatable at its next status update: until then preflight sees no GPU here.
  wait_for "the real node's fake GPUs allocatable" 60 bash -c \
    "kubectl get node '$REAL_NODE_NAME' -o jsonpath='{.status.allocatable.nvidia\.com/gpu}' | grep -qx 8"
  wait_for "cluster DNS" 60 bash -c "exec 3<>/dev/tcp/$NODE_IP/53" # from the host: the node's address is on-link
  log "real node $REAL_NODE_NAME Ready"
}

stop_pid() { # PID: TERM, then KILL after 10 s
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
}

stop() {
  local holder pid netns
  holder=$(holder_pid || true)
  # The kubelet first, so that it restarts nothing; then every container, by the cgroups it made.
  [[ -f $PIDS/kubelet.pid ]] && stop_pid "$(cat "$PIDS/kubelet.pid")"
  local dir procs
  while read -r dir; do
    [[ -d $dir ]] || continue
    # `|| true` on both: a container's cgroup that goes while it is read (find exits 1, pipefail) and a process
    # that ended before the kill each failed this line, and `set -e` ended the whole stop here, leaving the
    # node's containerd, its flock, CoreDNS, kube-router and the socats running (reproduced with a drain test).
    procs=$(find "$dir" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u || true)
    [[ -n $procs ]] && { kill -KILL $procs 2>/dev/null || true; }
  done < <(cgroup_dirs)
  [[ -n $holder ]] && empty_containerd_root
  # Then every process in the node's network namespace (containerd, its shims, CoreDNS, kube-router, the
  # holder): when the last one is gone, the namespaces go, and with them the veth pair and every mount.
  if [[ -n $holder ]] && netns=$(readlink "/proc/$holder/ns/net" 2>/dev/null); then
    local link
    for link in /proc/[0-9]*/ns/net; do
      pid=${link#/proc/} && pid=${pid%%/*}
      [[ $pid != "$holder" && $(readlink "$link" 2>/dev/null) == "$netns" ]] && stop_pid "$pid"
    done
    stop_pid "$holder"
  fi
  for pid in "$PIDS"/*.pid; do
    [[ -e $pid ]] && stop_pid "$(cat "$pid")"
    rm -f "$pid"
  done
  # Whatever of the node outlived the above, by its own directory in its command line.
  local left
  left=$(pgrep -f -- "$NODE_DIR/" || true)
  for pid in $left; do
    log "stopping $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120), left after the node's stop"
    stop_pid "$pid"
  done
  ip link show "$HOST_LINK" >/dev/null 2>&1 && { ip link del "$HOST_LINK" || true; }
  # The cgroups, deepest first, once empty (a killed process leaves its cgroup a moment later).
  while read -r dir; do
    [[ -d $dir ]] || continue
    for _ in $(seq 50); do
      find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || true # not empty yet: again
      [[ -d $dir ]] || break
      sleep 0.2
    done
    [[ -d $dir ]] && log "could not remove cgroup $dir: $(find "$dir" -name cgroup.procs -exec cat {} + | tr '\n' ' ' || true)"
  done < <(cgroup_dirs)
  return 0
}

case ${1:-} in
start) start ;;
stop) stop ;;
*)
  echo "usage: $0 start|stop" >&2
  exit 2
  ;;
esac
