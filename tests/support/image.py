"""The operator image (hack/image.sh) and a pod's container run with podman the way a kubelet runs it.

`pod_container_command` turns the operator container of a Deployment exactly as `helm template` rendered it
(image, command/args, env, securityContext, volumes, resources) into a `podman run` command line, with the
pod's in-cluster identity: a ServiceAccount token from the TokenRequest API, the cluster CA and the namespace
mounted at the service-account path, and KUBERNETES_SERVICE_HOST/PORT. Anything of the pod spec that it
cannot reproduce is refused, so a chart change that it would silently drop fails the test instead.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from tests.support.kube import kubectl
from tests.support.paths import REPO

CONTAINERS_CONF = REPO / "hack" / "containers.conf"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """podman with the project's containers.conf (runc, no default ulimits)."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], text=True, capture_output=True, check=check, env=env)


@functools.cache
def operator_image() -> str:
    """The image reference hack/image.sh built (a no-op when its content key is already built)."""
    built = subprocess.run([REPO / "hack" / "image.sh"], text=True, capture_output=True, check=False)
    if built.returncode != 0:
        raise RuntimeError(f"hack/image.sh failed:\n{built.stderr[-4000:]}")
    return built.stdout.strip().splitlines()[-1]


def service_account_files(kubeconfig: str, namespace: str, service_account: str, into: Path) -> Path:
    """What a kubelet projects at the service-account path: a bound token (TokenRequest), the CA, the
    namespace; readable by any uid, as the projected volume's default mode 0644 makes them."""
    config = yaml.safe_load(Path(kubeconfig).read_text())
    cluster = config["clusters"][0]["cluster"]
    into.mkdir(parents=True, exist_ok=True)
    token = kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").stdout.strip()
    (into / "token").write_text(token)
    if "certificate-authority" in cluster:
        (into / "ca.crt").write_bytes(Path(cluster["certificate-authority"]).read_bytes())
    else:
        import base64

        (into / "ca.crt").write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    (into / "namespace").write_text(namespace)
    into.chmod(0o755)
    for file in into.iterdir():
        file.chmod(0o644)
    return into


def apiserver_address(kubeconfig: str) -> tuple[str, int]:
    server = urlparse(yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]["server"])
    assert server.hostname and server.port, server
    return server.hostname, server.port


def _env(container: dict[str, Any], pod_name: str, namespace: str) -> list[str]:
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    out = []
    for var in container.get("env", []):
        if "value" in var:
            value = var["value"]
        else:
            ref = var["valueFrom"]["fieldRef"]["fieldPath"]  # KeyError: a source this runner cannot give
            value = fields[ref]
        out += ["--env", f"{var['name']}={value}"]
    assert not container.get("envFrom"), "envFrom is not reproduced"
    return out


def _security(pod: dict[str, Any], container: dict[str, Any], image_user: str) -> list[str]:
    pod_sc = pod.get("securityContext", {})
    sc = {**pod_sc, **container.get("securityContext", {})}
    out = []
    uid = sc.get("runAsUser")
    if sc.get("runAsNonRoot"):
        # The kubelet refuses to start a container that would run as root, or as a user it cannot verify.
        effective = str(uid) if uid is not None else image_user
        assert effective.split(":")[0].isdigit() and effective.split(":")[0] != "0", effective
    if uid is not None:
        out += ["--user", f"{uid}:{sc['runAsGroup']}" if "runAsGroup" in sc else str(uid)]
    if sc.get("readOnlyRootFilesystem"):
        out += ["--read-only", "--read-only-tmpfs=false"]  # only the pod's volumes are writable
    if sc.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    caps = sc.get("capabilities", {})
    out += [f"--cap-drop={c}" for c in caps.get("drop", [])] + [f"--cap-add={c}" for c in caps.get("add", [])]
    seccomp = sc.get("seccompProfile", {}).get("type", "RuntimeDefault")
    assert seccomp == "RuntimeDefault", f"seccomp {seccomp} is not reproduced"  # podman's default profile
    known = {
        "runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem", "allowPrivilegeEscalation",
        "capabilities", "seccompProfile",
    }  # fmt: skip
    assert set(sc) <= known, f"securityContext fields not reproduced: {set(sc) - known}"
    return out


def _volumes(pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out = []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        assert set(volume) == {"name", "emptyDir"}, f"volume {volume} is not reproduced"
        # An emptyDir: empty, writable by any uid, gone with the pod.
        out += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-mode=1777"]
    return out


def pod_container_command(
    deployment: dict[str, Any],
    *,
    name: str,
    token_dir: Path,
    apiserver: tuple[str, int],
    container_name: str = "operator",
) -> list[str]:
    """`podman run` arguments for the Deployment's container, run as a kubelet would in a pod named `name`."""
    pod = deployment["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == container_name]
    namespace = deployment["metadata"]["namespace"]
    image = container["image"]
    image_user = podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    pull = {"Always": "always", "IfNotPresent": "missing", "Never": "never"}[container["imagePullPolicy"]]
    limits = container.get("resources", {}).get("limits", {})
    memory = (
        [f"--memory={limits['memory'].replace('Gi', 'g').replace('Mi', 'm')}"] if "memory" in limits else []
    )
    command = ["--entrypoint", container["command"][0]] if container.get("command") else []
    # A Deployment's pods restart their containers (restartPolicy Always): an operator that exits on a lost
    # lease comes back as the kubelet would bring it back.
    policy = pod.get("restartPolicy", "Always")
    restart = {"Always": "always", "OnFailure": "on-failure", "Never": "no"}[policy]
    args = [*container.get("command", [])[1:], *container.get("args", [])]
    return [
        "run", "--detach", "--name", name, "--hostname", name, "--network", "host", f"--pull={pull}",
        f"--restart={restart}",
        *_security(pod, container, image_user),
        *_volumes(pod, container),
        "--volume", f"{token_dir}:{SERVICE_ACCOUNT_DIR}:ro",
        "--env", f"KUBERNETES_SERVICE_HOST={apiserver[0]}",
        "--env", f"KUBERNETES_SERVICE_PORT={apiserver[1]}",
        *_env(container, name, namespace),
        *memory,
        *command,
        image,
        *args,
    ]  # fmt: skip
