"""The apiserver from tests: the repo's kubectl, an in-process client for what tests poll, namespaces and what
the platform grants them."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from fsdp_operator import tenancy
from tests.support.paths import REPO
from tests.support.waiting import wait_until


def kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs the repo's kubectl against the local cluster (KUBECONFIG comes from the session fixture); with
    check, a failure says what kubectl printed."""
    done = subprocess.run(
        [str(REPO / "bin" / "kubectl"), *without_openapi_fetch(args)],
        input=input,
        text=True,
        capture_output=True,
    )
    if check and done.returncode != 0:
        output = (done.stderr.strip() or done.stdout.strip())[-2000:]
        raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}: {output}")
    return done


def without_openapi_fetch(args: tuple[str, ...]) -> tuple[str, ...]:
    """`apply` without the whole OpenAPI document, which a client-side apply fetches to compute its patch
    with a 32 s timeout of its own that a loaded 2-core host overran (issue 45: a test failed on it, not on
    the product): a server-side apply, or with `--server-side=false` a client-side one as a user's kubectl
    makes it, patched without the document (a custom resource takes a JSON merge patch anyway). Both
    validate on the apiserver, strictly."""
    if not args or args[0] != "apply" or "--server-side" in args or "--dry-run=client" in args:
        return args
    if "--server-side=false" in args:
        return ("apply", "--openapi-patch=false", "--validate=strict", *args[1:])
    return ("apply", "--server-side", "--force-conflicts", "--validate=strict", *args[1:])


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json").stdout)


def apply_crd() -> None:
    """Installs the generated FSDPTrainingRun CRD and waits until the apiserver serves it."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    wait_established("crd/fsdptrainingruns.fsdp.training.dev")


def wait_established(*crds: str) -> None:
    """`kubectl wait --for condition=established`, again while a just-created CRD has no conditions yet
    (kubectl then exits at once with "accessor error: <nil>" instead of waiting)."""
    wait_until(
        f"{', '.join(crds)} to be established",
        lambda: (
            kubectl(
                "wait", "--for", "condition=established", "--timeout", "10s", *crds, check=False
            ).returncode
            == 0
        ),
        timeout=60,
    )


# The toleration of the real node's taint: the platform grants it to the suite's namespaces (tenancy.py), as a
# platform grants a team the tolerations of its node pool.
REAL_NODE_TOLERATION = {"key": "fsdp.training.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}


def grant(namespace: str, annotation: str, value: str) -> None:
    """What the platform grants runs in a namespace, as the namespace annotation the operator reads."""
    kubectl("annotate", "namespace", namespace, "--overwrite", f"{annotation}={value}")


def delete_namespace(name: str) -> None:
    """Deletes a test's namespace once its operator is stopped: releases the runs' finalizers and waits for
    the pods only, so that the next test finds the fake GPUs free; the namespace may finish deleting later.
    The RayClusters go first (KubeRay would replace their pods) and the pods are deleted at once: left to the
    namespace controller, they took 5 s per test."""
    runs = kubectl("get", "fsdptrainingruns", "-n", name, "-o", "name", check=False).stdout.split()
    for run in runs:
        kubectl("patch", run, "-n", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
    kubectl("delete", "rayclusters", "--all", "-n", name, "--wait=false", check=False)
    kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false", check=False)
    kubectl("delete", "namespace", name, "--wait=false")
    wait_until(
        f"the pods of namespace {name} to be gone",
        lambda: not kubectl("get", "pods", "-n", name, "-o", "name", check=False).stdout.strip(),
        timeout=90,
    )


def apply(namespace: str, manifest: dict[str, Any]) -> None:
    """Applies a manifest as a user's `kubectl apply` does: client-side (field manager
    kubectl-client-side-apply), which the operator must never fight over the spec with."""
    kubectl("apply", "--server-side=false", "-n", namespace, "-f", "-", input=json.dumps(manifest))


@functools.cache
def _custom_objects(kubeconfig: str) -> Any:
    """An in-process client for what the tests poll every second (a run, a namespace's RayClusters): each
    `kubectl get` is a Go process start, about 0.1 CPU-s, and two workers polling spent minutes of the
    suite's two cores on them. Keyed by the kubeconfig's content: a restarted cluster has new certificates."""
    from kubernetes import client, config

    return client.CustomObjectsApi(config.new_client_from_config_dict(yaml.safe_load(kubeconfig)))


def custom_objects() -> Any:
    """The CustomObjectsApi of the cluster KUBECONFIG names."""
    return _custom_objects(Path(os.environ["KUBECONFIG"]).read_text())


def get_custom(what: str, call: Callable[[Any], Any]) -> Any:
    """call(a CustomObjectsApi) for the cluster KUBECONFIG names; an error says what was read."""
    from kubernetes.client.exceptions import ApiException

    try:
        return call(custom_objects())
    except ApiException as error:
        raise AssertionError(f"GET {what}: {error.status} {error.reason}: {error.body}") from None


@contextmanager
def fresh_namespace() -> Iterator[str]:
    """A namespace of its own, granted the real node's toleration as a platform grants a team its node pool's,
    deleted afterwards with everything in it."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    grant(name, tenancy.TOLERATIONS, json.dumps([REAL_NODE_TOLERATION]))
    try:
        yield name
    finally:
        delete_namespace(name)
