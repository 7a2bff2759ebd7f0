"""A run gets no more than its namespace's users could take by themselves, unless the platform grants it: no
Secret, service account token, priority, toleration or credential host by default; hardened pods; no way to
the instance metadata service."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from pydantic import ValidationError

from fsdp_operator import api, builder, conditions, tenancy
from fsdp_operator.reconcile import Observation, creates_cluster_next, reconcile
from fsdp_operator.settings import Settings

RUN = builder.RunRef(name="run", namespace="team-a", uid="0f1e2d3c-0000-4000-8000-000000000001")
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
DEDICATED = {"key": "dedicated", "operator": "Equal", "value": "team-a", "effect": "NoSchedule"}
EVERYTHING = {"operator": "Exists"}  # tolerates every taint: cordoned and dedicated nodes alike
PLATFORM = tenancy.Platform(s3_prefixes=("s3://b/",))  # where spec()'s checkpoints go


def spec(**fields: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}, **fields}
    )


def asks_for_everything() -> api.FSDPTrainingRunSpec:
    return spec(
        cluster={
            "serviceAccountName": "trainer",
            "priorityClassName": "urgent",
            "workloadPriorityClass": "high",
            "tolerations": [GPU_TOLERATION, EVERYTHING],
            "head": {"tolerations": [DEDICATED]},
        },
        runtimeEnv={"secretEnv": {"HF_TOKEN": {"name": "hf", "key": "token"}}},
        tracking={
            "mlflow": {
                "trackingUri": "https://mlflow.example.com",
                "credentials": {"token": {"name": "mlflow", "key": "token"}},
            }
        },
    )


def test_a_bare_namespace_grants_nothing_and_each_refusal_names_its_field() -> None:
    refused = tenancy.refusals(asks_for_everything(), tenancy.NamespacePolicy.of("team-a", {}), PLATFORM)
    fields = [line.split(":")[0] for line in refused]
    assert fields == [
        "spec.runtimeEnv.secretEnv.HF_TOKEN.name",
        "spec.tracking.mlflow.credentials.token.name",
        "spec.tracking.mlflow.trackingUri",
        "spec.cluster.serviceAccountName",
        "spec.cluster.priorityClassName",
        "spec.cluster.workloadPriorityClass",
        "spec.cluster.tolerations[1]",  # [0] is the GPU taint's, which the operator adds anyway
        "spec.cluster.head.tolerations[0]",
    ], refused
    assert "annotation fsdp.training.dev/run-secrets on the namespace lists: none" in refused[0]
    assert "not 'mlflow.example.com'" in refused[2]


def test_what_the_namespace_grants_and_the_platform_allows_is_used() -> None:
    annotations = {
        tenancy.SECRETS: "hf, mlflow",
        tenancy.SERVICE_ACCOUNTS: "trainer",
        tenancy.PRIORITY_CLASSES: "urgent",
        tenancy.WORKLOAD_PRIORITY_CLASSES: "high",
        tenancy.TOLERATIONS: json.dumps([EVERYTHING, DEDICATED]),
    }
    policy = tenancy.NamespacePolicy.of("team-a", annotations)
    allowing_mlflow = tenancy.Platform(frozenset({"mlflow.example.com"}), s3_prefixes=PLATFORM.s3_prefixes)
    assert tenancy.refusals(asks_for_everything(), policy, allowing_mlflow) == []
    # Another namespace's grants are not this one's.
    assert tenancy.refusals(asks_for_everything(), tenancy.NamespacePolicy.of("team-b", {}), PLATFORM)


def test_the_platforms_own_head_toleration_needs_no_grant() -> None:
    head_taint = api.Toleration(key="ray.io/head-node", operator="Exists", effect="NoSchedule")
    asked = spec(cluster={"head": {"tolerations": [head_taint.model_dump(exclude_none=True)]}})
    bare = tenancy.NamespacePolicy.of("team-a", {})
    with_head_taint = tenancy.Platform(head_tolerations=(head_taint,), s3_prefixes=PLATFORM.s3_prefixes)
    assert tenancy.refusals(asked, bare, with_head_taint) == []
    assert tenancy.refusals(asked, bare, PLATFORM) != []


def test_every_s3_uri_of_a_run_is_inside_its_namespaces_prefixes() -> None:
    platform = tenancy.Platform(s3_prefixes=("s3://ml-runs/{namespace}",))
    own = "s3://ml-runs/team-a"
    inside = spec(
        model={"source": f"{own}/models/qwen", "tokenizer": f"{own}/models/tok"},
        data={"source": f"{own}/data/train.jsonl", "evalSource": "s3://shared-data/eval.jsonl"},
        checkpoint={"storagePath": f"{own}/runs", "resume": f"{own}/runs/team-a/old/checkpoints/step_50"},
    )
    granted_shared = tenancy.NamespacePolicy.of("team-a", {tenancy.S3_PREFIXES: "s3://shared-data"})
    assert tenancy.refusals(inside, granted_shared, platform) == []

    # team-b's runs, the same manifest: every URI is in team-a's prefix, the shared one is not granted to it.
    refused = tenancy.refusals(inside, tenancy.NamespacePolicy.of("team-b", {}), platform)
    assert [line.split(":")[0] for line in refused] == [
        "spec.checkpoint.storagePath",
        "spec.checkpoint.resume",
        "spec.model.source",
        "spec.model.tokenizer",
        "spec.data.source",
        "spec.data.evalSource",
    ], refused
    assert "s3://ml-runs/team-b/; operator setting s3-prefixes" in refused[0]

    # A prefix is a whole segment (team-a is not team-ab), and no '..' climbs out of one.
    for storage in ("s3://ml-runs/team-ab/runs", "s3://ml-runs/team-a/../team-b/runs"):
        [refusal] = tenancy.refusals(spec(checkpoint={"storagePath": storage}), granted_shared, platform)
        assert refusal.startswith(f"spec.checkpoint.storagePath: {storage}"), refusal
    # No S3 grant at all (a bare install): nothing on S3.
    assert tenancy.refusals(spec(), tenancy.NamespacePolicy.of("team-a", {}), tenancy.Platform()) != []
    # What is not on S3 (a hub id, a local path, synthetic data) needs no grant.
    local = spec(model={"source": "Qwen/Qwen2.5-1.5B"}, data={"source": "synthetic"})
    assert tenancy.refusals(local, tenancy.NamespacePolicy.of("team-a", {}), PLATFORM) == []


def test_a_grant_the_operator_cannot_read_is_named() -> None:
    with pytest.raises(tenancy.PolicyError, match=r"annotation fsdp\.training\.dev/run-tolerations"):
        tenancy.NamespacePolicy.of("team-a", {tenancy.TOLERATIONS: "[{"})
    with pytest.raises(tenancy.PolicyError, match="run-secrets is longer than"):
        tenancy.NamespacePolicy.of("team-a", {tenancy.SECRETS: "s," * tenancy.MAX_ANNOTATION})


def test_a_refused_run_fails_naming_the_field_and_nothing_is_created() -> None:
    now = dt.datetime(2026, 12, 3, tzinfo=dt.UTC)
    refusal = "spec.cluster.priorityClassName: PriorityClass 'urgent' is not granted"
    obs = Observation(now=now, generation=1, cluster=None, refusals=(refusal,))
    decision = reconcile(spec(), api.FSDPTrainingRunStatus(), obs)
    assert decision.status.phase == api.Phase.FAILED and not decision.create_cluster
    failed = conditions.condition(decision.status.conditions, conditions.FAILED)
    assert failed is not None and failed.reason == tenancy.NOT_ALLOWED and refusal in failed.message


@pytest.mark.parametrize(
    "phase", [api.Phase.PROVISIONING, api.Phase.CLUSTER_READY, api.Phase.RUNNING, api.Phase.RESTARTING]
)
def test_a_cluster_rebuilt_after_a_loss_is_checked_against_the_grants_as_they_are_then(
    phase: api.Phase,
) -> None:
    """Issue 46's exploit: a Secret added to a running run's secretEnv (or a grant withdrawn since its first
    cluster) reached the RayCluster rebuilt after the first was lost, unchecked."""
    asked = spec(runtimeEnv={"secretEnv": {"HF_TOKEN": {"name": "hf", "key": "token"}}})
    running = api.FSDPTrainingRunStatus(phase=phase, attempt=1, job_submission_id="run-1")
    assert creates_cluster_next(asked, running, cluster_exists=False), "the glue would not check the grants"
    refused = tuple(tenancy.refusals(asked, tenancy.NamespacePolicy("team-a"), PLATFORM))
    now = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)
    decision = reconcile(asked, running, Observation(now=now, generation=2, cluster=None, refusals=refused))
    assert not decision.create_cluster, "a RayCluster would be built with a Secret never granted"
    assert decision.status.phase == api.Phase.FAILED
    failed = conditions.condition(decision.status.conditions, conditions.FAILED)
    assert failed is not None and failed.reason == tenancy.NOT_ALLOWED
    assert failed.message.startswith("spec.runtimeEnv.secretEnv.HF_TOKEN.name: Secret 'hf' is not granted")
    assert decision.stop_job == "run-1"  # the job of a lost cluster, if Ray still knows it


def test_a_run_with_its_cluster_or_finished_is_not_checked_again() -> None:
    running = api.FSDPTrainingRunStatus(phase=api.Phase.RUNNING)
    assert not creates_cluster_next(spec(), running, cluster_exists=True)
    assert not creates_cluster_next(spec(), api.FSDPTrainingRunStatus(phase=api.Phase.FAILED), False)
    assert not creates_cluster_next(spec(suspend=True), running, cluster_exists=False)


@pytest.mark.parametrize(
    "name",
    [
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "pip_trusted_host",
        "UV_INDEX_URL",
        "HTTPS_PROXY",
        "http_proxy",
        "NO_PROXY",
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "HF_ENDPOINT",
        "CONDA_PKGS_DIRS",
    ],
)
def test_env_that_steers_where_code_comes_from_or_whom_tls_trusts_is_refused(name: str) -> None:
    with pytest.raises(ValidationError, match=name):
        spec(runtimeEnv={"env": {name: "https://attacker.example"}})


def test_ray_pods_are_hardened_and_get_no_token_they_do_not_ask_for() -> None:
    manifest = builder.build_raycluster(spec(), RUN, "image:1", "us-west-2a")
    pods = [
        g["template"]["spec"]
        for g in (manifest["spec"]["headGroupSpec"], *manifest["spec"]["workerGroupSpecs"])
    ]
    for pod in pods:
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
        [container] = pod["containers"]
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
    granted = builder.build_raycluster(spec(cluster={"serviceAccountName": "trainer"}), RUN, "image:1", None)
    head = granted["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["serviceAccountName"] == "trainer" and "automountServiceAccountToken" not in head


def test_ray_pods_reach_anything_but_the_metadata_service_and_the_operators_namespace() -> None:
    settings = Settings(lease_namespace="fsdp-system")
    policy = builder.build_network_policy(RUN, settings.lease_namespace, {"app": "op"}, [])
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    addresses, pods = policy["spec"]["egress"]
    assert {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}} in addresses["to"]
    assert {"ipBlock": {"cidr": "::/0", "except": ["fd00:ec2::254/128"]}} in addresses["to"]
    [every_namespace_but] = pods["to"]
    [expression] = every_namespace_but["namespaceSelector"]["matchExpressions"]
    assert (expression["operator"], expression["values"]) == ("NotIn", ["fsdp-system"])
