#!/usr/bin/env bash
# Builds the Kubernetes control plane that lanekeeper's end-to-end tests run
# against: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
# kwok, each compiled from its Go module at the version pinned in the go.mod
# files beside this script (through the Go module proxy; nothing is
# downloaded prebuilt).
#
# The binaries land in a cache outside the repository, keyed by a hash of the
# pins, so a second run costs nothing:
#   ${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}/controlplane-<hash>/bin
# The script prints that bin directory on its last line of stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}"

command -v go >/dev/null 2>&1 || {
  echo "build.sh: the Go toolchain is missing; install Go >= 1.24 (https://go.dev/doc/install or 'apt-get install golang')" >&2
  exit 1
}

key="$(cat "$here/build.sh" "$here"/*/go.mod "$here"/*/go.sum | sha256sum | cut -c1-16)"
dest="$cache_root/controlplane-$key"
bin="$dest/bin"
want=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

have_all() {
  for b in "${want[@]}"; do [ -x "$bin/$b" ] || return 1; done
}

if have_all; then
  echo "control plane cached in $bin" >&2
  echo "$bin"
  exit 0
fi

mkdir -p "$dest"
# One builder at a time: concurrent test binaries may all ask for the build.
exec 9>"$dest/.lock"
flock 9
if have_all; then
  echo "$bin"
  exit 0
fi

tmp="$dest/bin.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
export CGO_ENABLED=0
export GOFLAGS="-mod=readonly -trimpath"
start=$(date +%s)

build() { # build <module dir> <output name> <package>
  local dir="$1" out="$2" pkg="$3" t0
  t0=$(date +%s)
  echo "building $out from $pkg (module $dir) ..." >&2
  (cd "$here/$dir" && go build -ldflags="-s -w" -o "$tmp/$out" "$pkg")
  echo "built $out in $(( $(date +%s) - t0 ))s" >&2
}

build etcd etcd go.etcd.io/etcd/server/v3
build kwok kwok sigs.k8s.io/kwok/cmd/kwok
build kube kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
build kube kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
build kube kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler

rm -rf "$bin"
mv "$tmp" "$bin"
echo "control plane built in $(( $(date +%s) - start ))s into $bin" >&2
echo "$bin"
