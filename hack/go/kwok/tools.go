//go:build tools

// Package tools pins the commands this module builds so `go mod tidy` keeps them.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
	_ "sigs.k8s.io/kwok/cmd/kwokctl"
)
