#!/usr/bin/env bash
# Fetches the third-party CRDs that config/monitoring, config/autoscaling and
# the chart's monitoring options create objects of, so that tests/monitoring.rs
# can apply those objects to a real kube-apiserver with strict validation:
#   - prometheus-operator: ServiceMonitor, PodMonitor, PrometheusRule
#     (example/prometheus-operator-crd/ of its Go module);
#   - KEDA: ScaledObject (config/crd/bases/ of its Go module).
# Each comes from its Go module at the version pinned below, through the Go
# module proxy (`go mod download`, checked against the Go checksum database);
# nothing else is downloaded.
#
# The files land in a cache outside the repository, keyed by a hash of this
# script, so a second run costs nothing:
#   ${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}/monitoring-crds-<hash>/
# The script prints that directory on its last line of stdout.
set -euo pipefail

prometheus_operator="github.com/prometheus-operator/prometheus-operator@v0.85.0"
keda="github.com/kedacore/keda/v2@v2.21.0"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${LANEKEEPER_CACHE:-$HOME/.cache/lanekeeper}"
key="$(sha256sum "$here/crds.sh" | cut -c1-12)"
dest="$cache_root/monitoring-crds-$key"
want=(
  monitoring.coreos.com_servicemonitors.yaml
  monitoring.coreos.com_podmonitors.yaml
  monitoring.coreos.com_prometheusrules.yaml
  keda.sh_scaledobjects.yaml
)

have_all() {
  for f in "${want[@]}"; do [ -s "$dest/$f" ] || return 1; done
}

command -v go >/dev/null 2>&1 || {
  echo "crds.sh: the Go toolchain is missing; install Go >= 1.24 (https://go.dev/doc/install or 'apt-get install golang')" >&2
  exit 1
}

if have_all; then
  echo "monitoring CRDs cached in $dest" >&2
  echo "$dest"
  exit 0
fi

mkdir -p "$dest"
exec 9>"$dest/.lock"
flock 9
if have_all; then
  echo "$dest"
  exit 0
fi

# The module's directory in the module cache (read-only, as Go leaves it).
module_dir() {
  local json dir
  # Outside any module, so no go.mod around decides anything.
  json="$(cd / && GOFLAGS=-mod=mod go mod download -json "$1")"
  dir="$(printf '%s\n' "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
  if [ -z "$dir" ] || [ ! -d "$dir" ]; then
    echo "crds.sh: go mod download $1 gave no module directory:" >&2
    printf '%s\n' "$json" >&2
    exit 1
  fi
  echo "$dir"
}

tmp="$dest/partial"
rm -rf "$tmp"
mkdir -p "$tmp"
po="$(module_dir "$prometheus_operator")"
for f in servicemonitors podmonitors prometheusrules; do
  cp "$po/example/prometheus-operator-crd/monitoring.coreos.com_$f.yaml" "$tmp/"
done
kd="$(module_dir "$keda")"
cp "$kd/config/crd/bases/keda.sh_scaledobjects.yaml" "$tmp/"
chmod u+w "$tmp"/*.yaml
printf '%s\n%s\n' "$prometheus_operator" "$keda" >"$tmp/VERSIONS"
mv "$tmp"/* "$dest/"
rmdir "$tmp"
echo "monitoring CRDs ($prometheus_operator, $keda) in $dest" >&2
echo "$dest"
