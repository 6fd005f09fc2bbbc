#!/usr/bin/env bash
# The local demo: a local Redis and control plane, the CRDs, a ShardSet, the
# controller, workers, ingest and a webhook receiver, playing a 200,000-record
# import against a dozen tenants' password resets (see examples/demo/).
# Needs what the tests need: cargo, Go (first run builds the control plane),
# redis-server and kubectl. Ctrl-C stops everything it started.
# As root on Debian or Ubuntu, a missing redis-server is installed with
# apt-get (and it says so); otherwise it stops with the command to run.
set -euo pipefail
cd "$(dirname "$0")"
source tests/prerequisites.sh
need_debian_packages redis-server=redis-server redis-cli=redis-tools
for tool in cargo go kubectl; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "error: '$tool' is not installed; see README.md, Prerequisites" >&2
    exit 1
  }
done
echo "==> building lanekeeper (release)"
cargo build --release --locked --bin lanekeeper --example demo
exec target/release/examples/demo "$@"
