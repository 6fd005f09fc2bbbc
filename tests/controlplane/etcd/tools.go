//go:build tools

// Package tools pins the etcd server that tests/controlplane/build.sh compiles.
package tools

import _ "go.etcd.io/etcd/server/v3"
