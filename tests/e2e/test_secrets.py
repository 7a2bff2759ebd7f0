"""A Secret for the Ray pods' environment goes by reference: the operator never reads it, and its value
appears nowhere the run is recorded."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

from fsdp_operator import tenancy
from fsdp_operator.settings import Settings
from tests.support.apiserver_audit import KOPF_USER_AGENT, OPERATOR_USER_AGENT, AuditLog
from tests.support.demo import BUCKET, RUN_TIMEOUT, SMALL, demo_run
from tests.support.kube import grant, kubectl
from tests.support.operator_process import OperatorProcess
from tests.support.runs import rayclusters, run_of, wait_for_phase


def test_a_secret_for_the_pods_env_is_passed_by_reference_and_its_value_is_recorded_nowhere(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any
) -> None:
    since = dt.datetime.now(dt.UTC)
    value = f"hf_{uuid.uuid4().hex}"
    kubectl("create", "secret", "generic", "hf", f"--from-literal=token={value}", "-n", namespace)
    grant(namespace, tenancy.SECRETS, "hf")
    secret_env = {"HF_TOKEN": {"name": "hf", "key": "token"}}
    name = demo_run(namespace, cleanupPolicy="KeepCluster", **SMALL, **{"runtimeEnv.secretEnv": secret_env})
    wait_for_phase(namespace, name, "Succeeded", timeout=RUN_TIMEOUT)

    [cluster] = rayclusters(namespace)
    reference = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        [container] = group["template"]["spec"]["containers"]
        assert reference in container["env"], container

    def s3_text(key: str) -> str:
        return str(s3.get_object(Bucket=BUCKET, Key=f"runs/{namespace}/{name}/{key}")["Body"].read().decode())

    records = {
        "the run": json.dumps(run_of(namespace, name)),
        "its events": kubectl("get", "events", "-n", namespace, "-o", "json").stdout,
        "the RayCluster": json.dumps(cluster),
        "the operator's log": lifecycle_operator.log.read_text(),
        "run.json": s3_text("run.json"),
        "progress.json": s3_text("progress.json"),
        # The job's processes have the value in their environment: the logs they leave must not carry it.
        "rank 0's log": s3_text("logs/attempt-1/rank-0.log"),
        "the driver log": s3_text("logs/attempt-1/driver.log"),
    }
    assert [where for where, text in records.items() if value in text] == []
    assert "step" in records["rank 0's log"] and run_of(namespace, name)["status"]["record"]["logsUri"]
    # The operator's own Secret requests: it creates the run's Ray token Secret, and reads (or makes) its key;
    # it never reads another Secret, the run's least of all.
    audit = AuditLog.of_local_cluster()
    key = Settings.model_fields["ray_auth_key_secret"].default
    requests = [
        request
        for agent in (KOPF_USER_AGENT, OPERATOR_USER_AGENT)
        for request in audit.requests(agent, since)
        if request.resource == "secrets"
    ]
    reads = [r for r in requests if r.verb != "create" and not (r.verb == "get" and r.name == key)]
    assert reads == [], "the operator read a Secret other than its own key"
    assert "hf" not in {r.name for r in requests}
