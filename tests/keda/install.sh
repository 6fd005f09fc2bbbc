#!/usr/bin/env bash
# Builds keda-check (main.go beside this script): KEDA's own admission checks
# for ScaledObjects (`ValidateTriggers`, `CheckReplicaCountBoundsAreValid`,
# `CheckFallbackValid` of github.com/kedacore/keda/v2/apis/keda/v1alpha1, the
# pure part of KEDA's validating webhook), at the KEDA version go.mod pins,
# compiled through the Go module proxy (go.sum checks every module).
# tests/monitoring.rs runs it on config/autoscaling: the CRD schema alone
# accepts objects KEDA's webhook would refuse.
#
# The binary lands in a cache outside the repository, keyed by a hash of
# this directory's sources, so a second run costs nothing:
#   ${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}/keda-check-<hash>/bin/keda-check
# The script prints that bin directory on its last line of stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}"
key="$(cat "$here/install.sh" "$here/main.go" "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-12)"
dest="$cache_root/keda-check-$key"
bin="$dest/bin"

command -v go >/dev/null 2>&1 || {
  echo "install.sh: the Go toolchain is missing; install Go >= 1.26 (https://go.dev/doc/install or 'apt-get install golang')" >&2
  exit 1
}

if [ -x "$bin/keda-check" ]; then
  echo "keda-check cached in $bin" >&2
  echo "$bin"
  exit 0
fi

mkdir -p "$dest"
exec 9>"$dest/.lock"
flock 9
if [ -x "$bin/keda-check" ]; then
  echo "$bin"
  exit 0
fi

tmp="$dest/bin.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
start=$(date +%s)
echo "building keda-check against $(grep kedacore "$here/go.mod" | xargs) ..." >&2
(cd "$here" && CGO_ENABLED=0 GOFLAGS="-mod=readonly -trimpath" go build -ldflags="-s -w" -o "$tmp/keda-check" .)
echo "built keda-check in $(( $(date +%s) - start ))s" >&2
rm -rf "$bin"
mv "$tmp" "$bin"
echo "$bin"
