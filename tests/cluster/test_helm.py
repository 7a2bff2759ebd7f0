"""The Helm chart installs on the local cluster, and its RBAC grants exactly what the operator uses."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from fsdp_operator.settings import Settings
from tests.support.chart import CHART, helm
from tests.support.kube import kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.waiting import wait_until


def can_i(verb: str, resource: str, namespace: str, service_account: str, subresource: str = "") -> bool:
    where = [f"--subresource={subresource}"] if subresource else []
    answer = kubectl(
        "auth", "can-i", verb, resource, *where, "-n", namespace, f"--as={service_account}", check=False
    )
    return answer.stdout.strip() == "yes"


def allowed(verb: str, group: str, resource: str, namespace: str, user: str) -> bool:
    """A SubjectAccessReview: unlike `kubectl auth can-i`, it needs no discovery of the resource (Kueue's CRDs
    are installed only by the tests that use Kueue)."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "resourceAttributes": {
                "namespace": namespace,
                "verb": verb,
                "group": group,
                "resource": resource,
            },
        },
    }
    answer = kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
    return bool(json.loads(answer.stdout)["status"].get("allowed"))


def template(*args: str) -> list[dict[str, Any]]:
    out = helm("template", "rel", str(CHART), "-n", "ops", "--kube-version", "1.35.0", *args).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_chart_lints_and_rejects_bad_values() -> None:
    lint = helm("lint", "--strict", str(CHART), check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    bad = helm("template", "x", str(CHART), "--set", "dashboardAddressMode=override", check=False)
    assert bad.returncode != 0 and "dashboardUrl" in bad.stderr
    typo = helm("template", "x", str(CHART), "--set", "observeIntervalSecond=5", check=False)
    assert typo.returncode != 0 and "observeIntervalSecond" in typo.stderr
    # Two replicas without leader election would both reconcile.
    both_active = helm("template", "x", str(CHART), "--set", "leaderElection.enabled=false", check=False)
    assert both_active.returncode != 0 and "replicaCount" in both_active.stderr
    single = ["--set", "leaderElection.enabled=false,replicaCount=1", "--kube-version", "1.35.0"]
    assert helm("template", "x", str(CHART), *single).returncode == 0
    no_replicas = helm("template", "x", str(CHART), "--set", "replicaCount=0", check=False)
    assert no_replicas.returncode != 0 and "replicaCount" in no_replicas.stderr


@pytest.mark.parametrize("mode", ["bare-install", "watch-one-namespace", "cluster-wide"])
def test_install_grants_the_operator_what_it_needs(namespace: str, crd_installed: None, mode: str) -> None:
    """A bare install (no values) handles its own namespace only; the platform opts namespaces in, or the
    whole cluster."""
    release = f"r{namespace[-6:]}"
    extra = {
        "bare-install": [],
        "watch-one-namespace": ["--set", f"watchNamespaces={{{namespace}}}"],
        "cluster-wide": ["--set", "clusterWide=true"],
    }[mode]
    scoped = mode != "cluster-wide"
    helm("install", release, str(CHART), "-n", namespace, "--wait=false", *extra)
    try:
        deployment = kubectl_json("get", "deployment", f"{release}-fsdp-operator", "-n", namespace)
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") or e.get("valueFrom") for e in container["env"]}
        assert (env["FSDP_OPERATOR_WATCH_NAMESPACES"] or "") == (namespace if scoped else "")
        # Two replicas, one of which leads through a Lease in the release namespace.
        spec = deployment["spec"]
        assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
        assert env["FSDP_OPERATOR_LEADER_ELECTION"] == "true"
        assert env["FSDP_OPERATOR_LEASE_NAMESPACE"] == namespace
        assert env["POD_NAME"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert env["FSDP_OPERATOR_HEALTH_PORT"] == str(ports.pop("health"))
        assert env["FSDP_OPERATOR_METRICS_PORT"] == str(ports.pop("metrics")) and not ports
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            assert container[probe]["httpGet"] == {"path": path, "port": "health", "scheme": "HTTP"}
        budget = kubectl_json("get", "poddisruptionbudget", f"{release}-fsdp-operator", "-n", namespace)
        assert budget["spec"]["maxUnavailable"] == 1
        sa = f"system:serviceaccount:{namespace}:{release}-fsdp-operator"
        assert can_i("patch", "fsdptrainingruns.fsdp.training.dev", namespace, sa, subresource="status")
        assert not can_i("update", "fsdptrainingruns.fsdp.training.dev", namespace, sa, subresource="status")
        needed = [
            ("watch", "fsdptrainingruns.fsdp.training.dev"),
            ("create", "rayclusters.ray.io"),
            ("get", "rayclusters.ray.io"),  # read before it is deleted: the run's own, by UID
            ("delete", "rayclusters.ray.io"),
            ("create", "events"),
            ("list", "events"),  # an autoscaler's word on a pod that waits for a node
        ]
        for verb, resource in needed:
            assert can_i(verb, resource, namespace, sa), f"{sa} cannot {verb} {resource}"
        assert allowed("list", "kueue.x-k8s.io", "workloads", namespace, sa), f"{sa} cannot list workloads"
        assert can_i("list", "nodes", "default", sa)  # preflight reads capacity cluster-wide
        # and, for scale-from-zero, what can add nodes and what every added node runs
        assert allowed("list", "karpenter.sh", "nodepools", "", sa), f"{sa} cannot list NodePools"
        assert allowed("list", "apps", "daemonsets", "", sa), f"{sa} cannot list DaemonSets"
        for verb in ("get", "create", "update"):
            assert can_i(verb, "leases.coordination.k8s.io", namespace, sa), f"{sa} cannot {verb} leases"
        assert not can_i("update", "leases.coordination.k8s.io", "default", sa)  # only its own namespace's
        assert not can_i("delete", "pods", namespace, sa)
        # Each run's token Secret and NetworkPolicy are created; no Secret there is ever read (the key's
        # get is limited to its own name).
        assert can_i("create", "secrets", namespace, sa)
        # Watched, to be created again if deleted, and put back (update) if made first or edited.
        for verb in ("create", "get", "list", "watch", "update"):
            assert can_i(verb, "networkpolicies.networking.k8s.io", namespace, sa), f"{sa} cannot {verb}"
        assert not can_i("delete", "networkpolicies.networking.k8s.io", namespace, sa)
        assert not can_i("get", "secrets", namespace, sa) and not can_i("list", "secrets", namespace, sa)
        assert can_i("create", "rayclusters.ray.io", "default", sa) is not scoped
    finally:
        helm("uninstall", release, "-n", namespace)
    assert (
        kubectl("get", "deployment", f"{release}-fsdp-operator", "-n", namespace, check=False).returncode != 0
    )


def test_rendered_manifests_follow_the_values() -> None:
    # Defaults: two replicas behind a PDB that lets a drain take one; probes and resources set; non-root.
    objects = template()
    [deployment] = of_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 65532
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["livenessProbe"] and container["readinessProbe"]
    [pdb] = of_kind(objects, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert not of_kind(objects, "CustomResourceDefinition")  # crds/ is Helm's, on the first install
    # One replica: no PDB (it would only get in the way); a PDB that blocks every drain is refused.
    single = template("--set", "replicaCount=1,leaderElection.enabled=false")
    assert not of_kind(single, "PodDisruptionBudget")
    for blocking in ("0", "0%"):
        refused = helm(
            "template",
            "x",
            str(CHART),
            "--set",
            f"podDisruptionBudget.maxUnavailable={blocking}",
            check=False,
        )
        assert refused.returncode != 0 and "maxUnavailable" in refused.stderr

    # Namespaces: a RoleBinding per watched namespace; by default the release's own; cluster-wide when asked.
    def runs_bindings(objects: list[dict[str, Any]]) -> tuple[set[str], bool]:
        namespaced = {
            o["metadata"]["namespace"]
            for o in of_kind(objects, "RoleBinding")
            if o["roleRef"]["name"] == "rel-fsdp-operator-runs"
        }
        cluster = "rel-fsdp-operator-runs" in {
            o["metadata"]["name"] for o in of_kind(objects, "ClusterRoleBinding")
        }
        return namespaced, cluster

    assert runs_bindings(template("--set", "watchNamespaces={team-a,team-b}")) == (
        {"team-a", "team-b"},
        False,
    )
    assert runs_bindings(objects) == ({"ops"}, False)
    assert runs_bindings(template("--set", "clusterWide=true")) == (set(), True)
    both = helm(
        "template",
        "x",
        str(CHART),
        "--kube-version",
        "1.35.0",
        "--set",
        "clusterWide=true,watchNamespaces={a}",
        check=False,
    )
    assert both.returncode != 0 and "watchNamespaces or clusterWide" in both.stderr
    # IRSA annotation, default image, extra environment.
    irsa = "arn:aws:iam::123456789012:role/fsdp-operator"
    custom = template(
        "--set", f"serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn={irsa}",
        "--set", "defaultImage=registry.example/ray:1,image.tag=9.9.9",
        "--set-json", 'extraEnv=[{"name":"FSDP_OPERATOR_TRAINER_DEVICE","value":"cpu"}]',
    )  # fmt: skip
    [sa] = of_kind(custom, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": irsa}
    [container] = of_kind(custom, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FSDP_OPERATOR_DEFAULT_IMAGE"] == "registry.example/ray:1"
    assert env["FSDP_OPERATOR_TRAINER_DEVICE"] == "cpu" and container["image"].endswith(":9.9.9")
    # The platform's switch for the fabric check's node labels, as the operator reads it.
    unlabelled = template("--set", "fabric.labelNodes=false,fabric.labelMaxPerNamespace=1")
    [container] = of_kind(unlabelled, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    fabric_env = {
        e["name"]: e["value"] for e in container["env"] if e["name"].startswith("FSDP_OPERATOR_FABRIC_LABEL")
    }
    read = Settings.model_validate(
        {k.removeprefix("FSDP_OPERATOR_").lower(): v for k, v in fabric_env.items()}
    )
    assert not read.fabric_label_nodes and read.fabric_label_max_per_namespace == 1
    assert read.fabric_label_max_per_run == 2 and read.fabric_label_window_seconds == 86400
    # Namespace users: aggregated into edit/admin and view, or not at all.
    roles = {o["metadata"]["name"]: o for o in of_kind(objects, "ClusterRole")}
    edit_labels = roles["rel-fsdp-operator-edit"]["metadata"]["labels"]
    assert edit_labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert roles["rel-fsdp-operator-view"]["metadata"]["labels"][
        "rbac.authorization.k8s.io/aggregate-to-view"
    ]
    plain = template("--set", "rbac.aggregateToDefaultRoles=false")
    assert "rel-fsdp-operator-edit" not in {o["metadata"]["name"] for o in of_kind(plain, "ClusterRole")}
    # Managed CRD: the generated one, kept on uninstall.
    [crd] = of_kind(template("--set", "crds.manage=true"), "CustomResourceDefinition")
    committed = yaml.safe_load((CHART / "crds" / "fsdptrainingruns.fsdp.training.dev.yaml").read_text())
    assert crd["spec"] == committed["spec"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_every_rendered_object_passes_a_server_side_dry_run(
    local_cluster: LocalCluster, namespace: str
) -> None:
    lists = json.dumps({namespace: {"serviceAccounts": ["trainer"]}})
    values = [
        ["--set", "crds.manage=true"],
        ["--set", f"watchNamespaces={{{namespace}}},replicaCount=1,leaderElection.enabled=false"],
        ["--set", "admissionPolicy.enabled=true", "--set-json", f"admissionPolicy.namespaces={lists}"],
    ]
    for extra in values:
        out = helm("template", "dry", str(CHART), "-n", namespace, "--kube-version", "1.35.0", *extra).stdout
        # Kinds of CRDs that may be absent here (Prometheus Operator) are only rendered when asked for.
        applied = kubectl("apply", "--dry-run=server", "-f", "-", input=out, check=False)
        assert applied.returncode == 0, applied.stderr


def test_operator_pod_is_admitted_where_pod_security_is_restricted(namespace: str) -> None:
    kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    [deployment] = of_kind(template(), "Deployment")
    # The chart's service account is not created here; the pod's security does not depend on it.
    spec = {**deployment["spec"]["template"]["spec"], "serviceAccountName": "default"}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator"}, "spec": spec}

    def create(manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        document = json.dumps(manifest)
        return kubectl("create", "-n", namespace, "--dry-run=server", "-f", "-", input=document, check=False)

    admitted = create(pod)
    assert admitted.returncode == 0, admitted.stderr
    # The namespace does enforce: the same pod without its security contexts is refused.
    loose = json.loads(json.dumps(pod))
    del loose["spec"]["securityContext"]
    for container in loose["spec"]["containers"]:
        del container["securityContext"]
    refused = create(loose)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr


def test_users_with_edit_manage_runs_and_view_reads_them(namespace: str, crd_installed: None) -> None:
    release = f"a{namespace[-6:]}"
    helm("install", release, str(CHART), "-n", namespace, "--wait=false", "--skip-crds")
    try:
        kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice", "-n", namespace)
        kubectl("create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob", "-n", namespace)
        # carol may only manage runs: the chart's own role, bound in one namespace.
        runs_only = f"--clusterrole={release}-fsdp-operator-edit"
        kubectl("create", "rolebinding", "carol-runs", runs_only, "--user=carol", "-n", namespace)
        run = "fsdptrainingruns.fsdp.training.dev"

        def aggregated() -> bool:
            return can_i("create", run, namespace, "alice") and can_i("list", run, namespace, "bob")

        wait_until("the aggregated roles to include runs", aggregated, timeout=30)
        assert can_i("delete", run, namespace, "alice")
        assert not can_i("create", run, namespace, "bob") and not can_i("create", run, "default", "alice")
        assert not can_i(
            "patch", run, namespace, "alice", subresource="status"
        )  # the status is the operator's
        assert can_i("create", run, namespace, "carol") and can_i("delete", run, namespace, "carol")
        for verb, resource in (("create", "pods"), ("get", "secrets"), ("create", "rayclusters.ray.io")):
            assert not can_i(verb, resource, namespace, "carol"), f"carol can {verb} {resource}"
        assert not can_i("create", run, "default", "carol")
    finally:
        helm("uninstall", release, "-n", namespace)


def test_crd_upgrade_through_the_chart_adds_a_field(namespace: str, tmp_path: Path) -> None:
    """crds.manage: `helm upgrade` updates the CRD (Helm never does for crds/). A copy of the chart under a
    group of its own stands for the old and new versions, so the real CRD is never touched."""
    group = f"u{uuid.uuid4().hex[:6]}.fsdp.training.dev"
    crd_name = f"fsdptrainingruns.{group}"

    def chart_version(name: str, drop_field: bool) -> Path:
        copy = tmp_path / name
        subprocess.run(["cp", "-r", str(CHART), str(copy)], check=True)
        path = copy / "crds" / "fsdptrainingruns.fsdp.training.dev.yaml"
        crd = yaml.safe_load(path.read_text().replace("fsdp.training.dev", group))
        if drop_field:
            spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            del spec["properties"]["suspend"]
        path.write_text(yaml.safe_dump(crd))
        return copy

    def served_spec_fields() -> set[str]:
        live = kubectl_json("get", "crd", crd_name)
        return set(
            live["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        )

    release = f"u{namespace[-6:]}"
    common = ["-n", namespace, "--set", "crds.manage=true,rbac.aggregateToDefaultRoles=false", "--wait=false"]
    try:
        helm("install", release, str(chart_version("old", drop_field=True)), "--skip-crds", *common)
        assert "suspend" not in served_spec_fields()
        helm("upgrade", release, str(chart_version("new", drop_field=False)), *common)
        assert "suspend" in served_spec_fields()
        helm("uninstall", release, "-n", namespace)
        assert kubectl("get", "crd", crd_name, check=False).returncode == 0  # kept: deleting it deletes runs
    finally:
        helm("uninstall", release, "-n", namespace, check=False)
        kubectl("delete", "crd", crd_name, "--ignore-not-found")
