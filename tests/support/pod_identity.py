"""The real amazon-eks-pod-identity-webhook (IRSA's mutating webhook, EKS's own) for the tests that need it.

The webhook (bin/pod-identity-webhook, built by hack/build-tools.sh from the Go module proxy) runs out of
cluster as a process with a serving certificate of the harness's, and a MutatingWebhookConfiguration sends it
the pods of the test's namespaces only, with failurePolicy Ignore: a webhook that died never blocks another
test's pods. As on EKS, it gives each container of a pod whose service account carries
eks.amazonaws.com/role-arn AWS_ROLE_ARN, AWS_WEB_IDENTITY_TOKEN_FILE and a projected service-account token
(audience sts.amazonaws.com), which the kubelet keeps fresh; the pod's AWS SDK trades it for the role's
credentials with STS's AssumeRoleWithWebIdentity (here moto's, the local S3 server, which does not check the
token's signature).

v0.6.17 answers AdmissionReviews without TypeMeta, which the apiserver refuses under admission/v1: the
configuration asks for v1beta1. Its servers have no address flag and listen on every interface: both get free
ports, the apiserver calls 127.0.0.1.
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.support.kube import kubectl
from tests.support.net import free_port
from tests.support.paths import REPO
from tests.support.processes import stop_process
from tests.support.tls import self_signed_cert
from tests.support.waiting import wait_until

WEBHOOK_BIN = REPO / "bin" / "pod-identity-webhook"
TOKEN_AUDIENCE = "sts.amazonaws.com"
REGION = "us-west-2"


def _configuration(name: str, namespaces: list[str], port: int, ca: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "pod-identity-webhook.amazonaws.com",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{port}/mutate",
                    "caBundle": base64.b64encode(ca).decode(),
                },
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ],
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces}
                    ]
                },
                "failurePolicy": "Ignore",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1beta1"],
                "timeoutSeconds": 10,
            }
        ],
    }


@contextmanager
def pod_identity_webhook(
    kubeconfig: str, namespaces: list[str], workdir: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """The webhook serving `namespaces` until the block ends; then its configuration is deleted and the
    process stopped by pid."""
    certificate = self_signed_cert(workdir / "certs", "pod-identity-webhook")
    port, metrics_port = free_port(), free_port()
    log = (workdir / "pod-identity-webhook.log").open("wb")
    process = subprocess.Popen(
        [
            str(WEBHOOK_BIN),
            "--in-cluster=false",
            f"--kubeconfig={kubeconfig}",
            f"--tls-cert={certificate}",
            f"--tls-key={certificate.with_name('tls.key')}",
            f"--port={port}",
            f"--metrics-port={metrics_port}",
            f"--token-audience={TOKEN_AUDIENCE}",
            f"--aws-default-region={REGION}",
            "--sts-regional-endpoint=true",
            "--logtostderr",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    name = f"pod-identity-{namespaces[0]}"
    try:
        wait_until(
            f"the pod identity webhook's /healthz on 127.0.0.1:{port} (log: {log.name})",
            lambda: process.poll() is None and _healthy(port, certificate),
            timeout=30,
            interval=0.3,
        )
        configuration = _configuration(name, namespaces, port, certificate.read_bytes())
        kubectl("apply", "-f", "-", input=yaml.safe_dump(configuration))
        yield process
    finally:
        kubectl("delete", "mutatingwebhookconfiguration", name, "--ignore-not-found", check=False)
        stop_process(process)
        log.close()


def _healthy(port: int, certificate: Path) -> bool:
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=str(certificate))
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=5, context=context):
            return True
    except OSError:
        return False
