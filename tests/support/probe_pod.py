"""A short-lived pod on the local cluster's real node that runs a Python snippet in the DLC stand-in image and
reports what it printed: how the tests look at the node's network from a pod's side."""

from __future__ import annotations

import json
import uuid

from tests.support.kube import kubectl, kubectl_json
from tests.support.waiting import wait_until

TOLERATE_REAL_NODE = [{"key": "fsdp.training.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}]
# A pod start waits for CPU on the node's 2 cores beside a whole RayCluster, under a loaded host.
PROBE_TIMEOUT = 300


def run_probe(namespace: str, image: str, node: str, command: str) -> tuple[str, str]:
    """Runs `python -c command` in a pod bound to `node`: its phase at the end and its log. A probe that does
    not finish fails with the pod's status and events, which say where it stopped."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node,
            "tolerations": TOLERATE_REAL_NODE,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", command],
                    "resources": {
                        "requests": {"cpu": "50m", "memory": "64Mi"},
                        "limits": {"memory": "256Mi"},
                    },
                }
            ],
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps(pod))

    def finished() -> str | None:
        phase = kubectl_json("get", "pod", name, "-n", namespace)["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    try:
        phase = wait_until(f"probe pod {name} to finish", finished, timeout=PROBE_TIMEOUT)
    except AssertionError as timed_out:
        described = kubectl("describe", "pod", name, "-n", namespace, check=False).stdout
        raise AssertionError(f"{timed_out}\n{described[-3000:]}") from None
    return phase, kubectl("logs", "-n", namespace, name).stdout
