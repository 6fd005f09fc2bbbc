#!/usr/bin/env bash
# Installs the Helm CLI that tests/packaging.rs lints, renders and installs
# the chart with: helm.sh/helm/v3 compiled from its Go module through the Go
# module proxy (no prebuilt binary is downloaded), at the version pinned
# below.
#
# The binary lands in a cache outside the repository, so a second run costs
# nothing:
#   ${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}/helm-<version>-<hash of this script>/bin/helm
# The script prints that bin directory on its last line of stdout.
# `LANEKEEPER_HELM=/path/to/helm` makes the tests use another helm instead.
set -euo pipefail

version="v3.22.0"
# The Kubernetes version helm assumes without a cluster (`helm template`,
# `helm lint`, .Capabilities.KubeVersion): helm's Makefile derives it from the
# k8s.io/client-go version in its go.mod (v0.37.0 for helm v3.22.0, so 1.37);
# `go install` does not run the Makefile, so it is stamped here.
kube_major=1
kube_minor=37
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}"
key="$(sha256sum "$here/install.sh" | cut -c1-12)"
dest="$cache_root/helm-$version-$key"
bin="$dest/bin"

command -v go >/dev/null 2>&1 || {
  echo "install.sh: the Go toolchain is missing; install Go >= 1.24 (https://go.dev/doc/install or 'apt-get install golang')" >&2
  exit 1
}

if [ -x "$bin/helm" ]; then
  echo "helm $version cached in $bin" >&2
  echo "$bin"
  exit 0
fi

mkdir -p "$dest"
# One builder at a time: concurrent test binaries or CI steps may all ask.
exec 9>"$dest/.lock"
flock 9
if [ -x "$bin/helm" ]; then
  echo "$bin"
  exit 0
fi

tmp="$dest/bin.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
start=$(date +%s)
echo "building helm $version from helm.sh/helm/v3/cmd/helm ..." >&2
# `go install pkg@version` builds the module exactly as its own go.mod and
# go.sum pin it; -X stamps what helm's Makefile would.
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags="$ldflags -X $pkg.k8sVersionMajor=$kube_major -X $pkg.k8sVersionMinor=$kube_minor"
done
CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS="-mod=mod -trimpath" \
  go install -ldflags="$ldflags" "helm.sh/helm/v3/cmd/helm@$version"
"$tmp/helm" version --short >&2
rm -rf "$bin"
mv "$tmp" "$bin"
echo "helm built in $(( $(date +%s) - start ))s into $bin" >&2
echo "$bin"
