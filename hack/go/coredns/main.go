// Cluster DNS for the local cluster's real node: a CoreDNS with only the plugins it needs (bind, errors,
// log, cache, hosts, kubernetes), built as a library the way CoreDNS documents custom builds. Without the
// forward plugin, any name outside the cluster domain and the few the Corefile lists in hosts (AWS STS at its
// real name, answered with the host's end of the pod segment) is REFUSED: nothing is ever sent upstream.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
)

func init() {
	dnsserver.Directives = []string{"bind", "errors", "log", "cache", "hosts", "kubernetes"}
}

func main() { coremain.Run() }
