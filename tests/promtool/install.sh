#!/usr/bin/env bash
# Installs promtool, Prometheus's own rule checker, rule unit tester and
# PromQL parser, that tests/monitoring.rs checks the alerts and the
# dashboard's queries with: github.com/prometheus/prometheus/cmd/promtool
# compiled from its Go module through the Go module proxy (no prebuilt
# binary is downloaded), at the version pinned below (Go module v0.316.0 is
# Prometheus v3.16.0).
#
# The binary lands in a cache outside the repository, so a second run costs
# nothing:
#   ${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}/promtool-<version>-<hash of this script>/bin/promtool
# The script prints that bin directory on its last line of stdout.
# `LANEKEEPER_PROMTOOL=/path/to/promtool` makes the tests use another one.
set -euo pipefail

version="v0.316.0"
# The Prometheus release that Go module version is.
prometheus_version="3.16.0"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}"
key="$(sha256sum "$here/install.sh" | cut -c1-12)"
dest="$cache_root/promtool-$version-$key"
bin="$dest/bin"

command -v go >/dev/null 2>&1 || {
  echo "install.sh: the Go toolchain is missing; install Go >= 1.26.7, which its go.mod asks for (https://go.dev/doc/install or 'apt-get install golang')" >&2
  exit 1
}

if [ -x "$bin/promtool" ]; then
  echo "promtool $version cached in $bin" >&2
  echo "$bin"
  exit 0
fi

mkdir -p "$dest"
# One builder at a time: concurrent test binaries or CI steps may all ask.
exec 9>"$dest/.lock"
flock 9
if [ -x "$bin/promtool" ]; then
  echo "$bin"
  exit 0
fi

tmp="$dest/bin.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
start=$(date +%s)
echo "building promtool $version from github.com/prometheus/prometheus/cmd/promtool ..." >&2
# `go install pkg@version` builds the module exactly as its own go.mod and
# go.sum pin it; -X stamps the version Prometheus's Makefile would.
CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS="-mod=mod -trimpath" \
  go install -ldflags="-s -w -X github.com/prometheus/common/version.Version=$prometheus_version" \
  "github.com/prometheus/prometheus/cmd/promtool@$version"
"$tmp/promtool" --version >&2
rm -rf "$bin"
mv "$tmp" "$bin"
echo "promtool built in $(( $(date +%s) - start ))s into $bin" >&2
echo "$bin"
