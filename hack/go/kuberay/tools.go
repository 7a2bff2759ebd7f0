//go:build tools

// Package tools pins the commands this module builds so `go mod tidy` keeps them.
package tools

import (
	_ "github.com/ray-project/kuberay/ray-operator"
)
