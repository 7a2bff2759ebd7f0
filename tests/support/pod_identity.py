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
configuration asks for v1beta1. Its servers have no address flag and listen on every interface, so it runs
in a network namespace of its own (tests/support/netns.py): the apiserver calls its webhook port at the
host's 127.0.0.1, forwarded in.

Pods meet STS as on EKS, at its regional name over TLS: pyarrow's bundled AWS SDK (aws-c-auth's web-identity
provider, under Ray Train's storage and the trainer's) asks https://sts.<region>.amazonaws.com:443, and takes
AWS_ENDPOINT_URL(_STS) for a bare host name (a URL there is "invalid for dns resolution", and the SDK goes on
without credentials). The local cluster's DNS answers that one name with the host's end of the pod segment,
where a TLS forwarder hands it to moto (hack/real-node.sh).
"""

from __future__ import annotations

import base64
import subprocess
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.support.kube import kubectl
from tests.support.net import free_port
from tests.support.netns import in_network_namespace
from tests.support.paths import REPO
from tests.support.tls import self_signed_cert
from tests.support.waiting import wait_until

WEBHOOK_BIN = REPO / "bin" / "pod-identity-webhook"
TOKEN_AUDIENCE = "sts.amazonaws.com"
REGION = "us-west-2"
ROLE_ANNOTATION = "eks.amazonaws.com/role-arn"
# Kubernetes mounts the cluster's CA beside every pod's service-account token. The local STS's certificate
# comes from it, as AWS's comes from a public CA the images trust.
POD_CLUSTER_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


def irsa_pod_env(pod_env_without_credentials: dict[str, str]) -> dict[str, str]:
    """ray-pod-env as on an EKS platform whose pods get credentials from IRSA, from one that names the local
    S3 in AWS_ENDPOINT_URL: S3's endpoint for S3 alone (AWS_ENDPOINT_URL_S3, which boto3 and pyarrow honour),
    so that STS is AWS's own name, and the CA its certificate comes from, for pyarrow (SSL_CERT_FILE, through
    Python's default verify paths) and for botocore (AWS_CA_BUNDLE)."""
    env = dict(pod_env_without_credentials)
    env["AWS_ENDPOINT_URL_S3"] = env.pop("AWS_ENDPOINT_URL")
    return {**env, "SSL_CERT_FILE": POD_CLUSTER_CA, "AWS_CA_BUNDLE": POD_CLUSTER_CA}


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
    port = free_port()
    server = yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
    argv = [
        str(WEBHOOK_BIN),
        "--in-cluster=false",
        f"--kubeconfig={kubeconfig}",
        f"--tls-cert={certificate}",
        f"--tls-key={certificate.with_name('tls.key')}",
        f"--port={port}",
        "--metrics-port=9999",  # its namespace's own: nothing else listens there
        f"--token-audience={TOKEN_AUDIENCE}",
        f"--aws-default-region={REGION}",
        "--sts-regional-endpoint=true",
        "--logtostderr",
    ]
    log = workdir / "pod-identity-webhook.log"
    name = f"pod-identity-{namespaces[0]}"
    with in_network_namespace(argv, log, urllib.parse.urlsplit(server).port or 443, port) as process:
        try:
            wait_until(
                f"the pod identity webhook's /healthz on 127.0.0.1:{port} (log: {log})",
                lambda: process.poll() is None and _healthy(port, certificate),
                timeout=30,
                interval=0.3,
            )
            configuration = _configuration(name, namespaces, port, certificate.read_bytes())
            kubectl("apply", "-f", "-", input=yaml.safe_dump(configuration))
            yield process
        finally:
            kubectl("delete", "mutatingwebhookconfiguration", name, "--ignore-not-found", check=False)


def _healthy(port: int, certificate: Path) -> bool:
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=str(certificate))
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=5, context=context):
            return True
    except OSError:
        return False
