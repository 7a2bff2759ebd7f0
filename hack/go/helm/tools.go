//go:build tools

// Package tools pins the commands this module builds so `go mod tidy` keeps them.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
