//go:build tools

// Package tools pins kwok, which gives the test cluster fake nodes.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
