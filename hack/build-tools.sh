#!/usr/bin/env bash
# Builds the local cluster's binaries from the Go module proxy into a cache outside the repo, keyed by
# version and by the wrapper module's go.sum, and links them into ./bin. A binary already in the cache
# is never rebuilt. Each build's wall time and peak memory go to $CACHE/build-times.tsv (side by side with
# other builds, on a fresh machine: see the chains below).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/hack/lib.sh"

K8S_VERSION=v1.35.4
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.7.0
HELM_VERSION=v3.19.5
KUBERAY_VERSION=v1.6.2
KUEUE_VERSION=v0.17.0
# v1.14.1: the newest whose go.mod this machine's Go (1.26.8) builds without another toolchain (v1.14.3 and
# v1.15.0 ask for 1.26.9 or later).
KARPENTER_VERSION=v1.14.1
COREDNS_VERSION=v1.15.0
KUBE_ROUTER_VERSION=v2.1.0 # the only v2 the module proxy serves (v2.6.1 answers 403)
POD_IDENTITY_WEBHOOK_VERSION=v0.6.17 # the only version the module proxy lists

k8s_minor=${K8S_VERSION#v1.}
k8s_minor=${k8s_minor%%.*}
k8s_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# name | wrapper module | package | version | extra ldflags
components=(
  "etcd|etcd|go.etcd.io/etcd/server/v3|$ETCD_VERSION|"
  "kube-apiserver|k8s|k8s.io/kubernetes/cmd/kube-apiserver|$K8S_VERSION|$k8s_ldflags"
  "kube-controller-manager|k8s|k8s.io/kubernetes/cmd/kube-controller-manager|$K8S_VERSION|$k8s_ldflags"
  "kube-scheduler|k8s|k8s.io/kubernetes/cmd/kube-scheduler|$K8S_VERSION|$k8s_ldflags"
  "kubectl|k8s|k8s.io/kubernetes/cmd/kubectl|$K8S_VERSION|$k8s_ldflags"
  "kubelet|kubelet|k8s.io/kubernetes/cmd/kubelet|$K8S_VERSION|$k8s_ldflags"
  "coredns|coredns|fsdp-operator.dev/hack/coredns|$COREDNS_VERSION|-X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION"
  "kube-router|kube-router|github.com/cloudnativelabs/kube-router/v2/cmd/kube-router|$KUBE_ROUTER_VERSION|-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION"
  "kwok|kwok|sigs.k8s.io/kwok/cmd/kwok|$KWOK_VERSION|-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$K8S_VERSION"
  "kwokctl|kwok|sigs.k8s.io/kwok/cmd/kwokctl|$KWOK_VERSION|-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$K8S_VERSION"
  "helm|helm|helm.sh/helm/v3/cmd/helm|$HELM_VERSION|-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  "ray-operator|kuberay|github.com/ray-project/kuberay/ray-operator|$KUBERAY_VERSION|"
  "kueue|kueue|sigs.k8s.io/kueue/cmd/kueue|$KUEUE_VERSION|-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION -X sigs.k8s.io/kueue/pkg/version.BuildDate=1970-01-01T00:00:00Z"
  # Karpenter's KWOK cloud provider (main package sigs.k8s.io/karpenter/kwok), named so as not to shadow kwok.
  "karpenter-kwok|karpenter|sigs.k8s.io/karpenter/kwok|$KARPENTER_VERSION|-X sigs.k8s.io/karpenter/pkg/operator.Version=$KARPENTER_VERSION"
  "argocd-health-test|argocd-health|fsdp-operator.dev/hack/argocd-health|local|"
  "pod-identity-webhook|pod-identity-webhook|github.com/aws/amazon-eks-pod-identity-webhook|$POD_IDENTITY_WEBHOOK_VERSION|-X main.webhookVersion=$POD_IDENTITY_WEBHOOK_VERSION"
  "argocd|argocd|github.com/argoproj/argo-cd/v2/cmd|v2.14.21|-X github.com/argoproj/argo-cd/v2/common.version=2.14.21 -X github.com/argoproj/argo-cd/v2/common.gitTreeState=clean"
)

# build ENTRY: one component, unless the cache has it; then its link in ./bin. The linker's -s -w drop the
# symbol table and DWARF, so the compiler is told not to write DWARF at all (bench/go_build.py: 0.88-0.91 of the
# CPU of a cold build); the cache key leaves the flags out: the code built is the same.
build() {
  local name module pkg version ldflags sources sum target start
  IFS='|' read -r name module pkg version ldflags <<<"$1"
  # A module with a program of its own (main.go) is keyed by that source too.
  sources=("$root/hack/go/$module/go.sum")
  if [[ -f $root/hack/go/$module/main.go ]]; then sources+=("$root/hack/go/$module/main.go"); fi
  sum=$(cat "${sources[@]}" | sha256sum | cut -c1-12)
  target="$CACHE/tools/$name-$version-$sum/$name"
  if [[ ! -x $target ]]; then
    log "building $name $version (module hack/go/$module)"
    mkdir -p "$(dirname "$target")"
    start=$(date +%s)
    (cd "$root/hack/go/$module" &&
      /usr/bin/time -f "%M" -o "$target.maxrss" \
        go build -trimpath -gcflags=all=-dwarf=false -ldflags "-s -w $ldflags" -o "$target.tmp" "$pkg")
    mv "$target.tmp" "$target"
    printf '%s\t%s\t%ss\t%sMiB\n' "$name" "$version" "$(($(date +%s) - start))" \
      "$(($(cat "$target.maxrss") / 1024))" | tee -a "$CACHE/build-times.tsv"
  fi
  ln -sfn "$target" "$root/bin/$name"
}

# The components in chains, BUILD_JOBS chains at a time: on a fresh machine half of a build is fetching and
# unpacking modules, which another chain's compiles overlap, and each link is single-threaded. A chain is a
# wrapper module's components in order (they share its compiled packages); the kubelet's module pins the same
# k8s.io versions as k8s's, so it follows k8s's chain and reuses them instead of compiling them beside it.
if [[ ${1:-} == --cluster ]]; then set -- "${CLUSTER_TOOLS[@]}"; fi
only=("$@")
mkdir -p "$CACHE/tools" "$root/bin"
declare -A chain_entries=()
chains=()
for entry in "${components[@]}"; do
  IFS='|' read -r name module _ <<<"$entry"
  if ((${#only[@]})) && [[ " ${only[*]} " != *" $name "* ]]; then continue; fi
  chain=$module
  [[ $module == kubelet ]] && chain=k8s
  [[ -v chain_entries[$chain] ]] || chains+=("$chain")
  chain_entries[$chain]+="$entry"$'\n'
done
builders=()
for chain in "${chains[@]}"; do
  while (($(jobs -rp | wc -l) >= ${BUILD_JOBS:-3})); do wait -n || true; done
  (
    mapfile -t entries <<<"${chain_entries[$chain]}"
    for entry in "${entries[@]}"; do
      if [[ -n $entry ]]; then build "$entry"; fi
    done
  ) &
  builders+=($!)
done
failed=0
for builder in "${builders[@]}"; do wait "$builder" || failed=1; done
((failed == 0)) || { log "a Go build failed (its output is above)"; exit 1; }

# KubeRay's CRDs, from the same module version as the operator binary, so that cluster-up needs no Go.
if ((${#only[@]} == 0)) || [[ " ${only[*]} " == *" ray-operator "* ]]; then
  sum=$(sha256sum "$root/hack/go/kuberay/go.sum" | cut -c1-12)
  crds="$CACHE/tools/kuberay-crds-$KUBERAY_VERSION-$sum"
  if [[ ! -d $crds ]]; then
    module_dir=$(cd "$root/hack/go/kuberay" && go list -m -f '{{.Dir}}' github.com/ray-project/kuberay/ray-operator)
    cp -r "$module_dir/config/crd/bases" "$crds.tmp"
    chmod -R u+w "$crds.tmp"
    mv "$crds.tmp" "$crds"
  fi
  ln -sfn "$crds" "$root/bin/kuberay-crds"
fi

# Kueue's CRDs, from the same module version as its manager (tests/kueue.py installs them when a test needs Kueue).
if ((${#only[@]} == 0)) || [[ " ${only[*]} " == *" kueue "* ]]; then
  sum=$(sha256sum "$root/hack/go/kueue/go.sum" | cut -c1-12)
  crds="$CACHE/tools/kueue-crds-$KUEUE_VERSION-$sum"
  if [[ ! -d $crds ]]; then
    module_dir=$(cd "$root/hack/go/kueue" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
    cp -r "$module_dir/config/components/crd/bases" "$crds.tmp"
    chmod -R u+w "$crds.tmp"
    mv "$crds.tmp" "$crds"
  fi
  ln -sfn "$crds" "$root/bin/kueue-crds"
fi

# Karpenter's CRDs (NodePool, NodeClaim, ... and the KWOK provider's KWOKNodeClass), from the same module version as
# karpenter-kwok (tests/support/karpenter.py installs them when a test needs Karpenter).
if ((${#only[@]} == 0)) || [[ " ${only[*]} " == *" karpenter-kwok "* ]]; then
  sum=$(sha256sum "$root/hack/go/karpenter/go.sum" | cut -c1-12)
  crds="$CACHE/tools/karpenter-crds-$KARPENTER_VERSION-$sum"
  if [[ ! -d $crds ]]; then
    module_dir=$(cd "$root/hack/go/karpenter" && go list -m -f '{{.Dir}}' sigs.k8s.io/karpenter)
    mkdir "$crds.tmp"
    cp "$module_dir"/kwok/charts/crds/*.yaml "$module_dir"/kwok/apis/crds/*.yaml "$crds.tmp"
    chmod -R u+w "$crds.tmp"
    mv "$crds.tmp" "$crds"
  fi
  ln -sfn "$crds" "$root/bin/karpenter-crds"
fi
