"""The CRD is generated from the pydantic models and stays structural."""

from __future__ import annotations

from typing import Any

import yaml

from fsdp_operator import api, conditions, crd
from kubectl_trainingrun import cli


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found.extend(_walk(value, f"{path}.{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_walk(value, f"{path}[{i}]"))
    return found


def test_committed_crd_and_chart_copy_match_the_models() -> None:
    expected = crd.render()
    for path in (crd.CRD_FILE, crd.CHART_CRD_FILE):
        assert path.read_text() == expected, f"{path} is stale: run `python -m fsdp_operator.crd`"


def test_schema_is_structural() -> None:
    schema = crd.openapi_schema()
    for path, node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert node.get("type") != "null", path
        if "properties" in node:
            assert node.get("type") == "object", path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert node.get("type") == "object", path


def test_defaults_are_valid_and_optional_fields_stay_absent() -> None:
    # The apiserver refuses a CRD whose object default lacks a required field; and a default on an
    # Optional field would turn "not set" into a value (tracking.mlflow: {} would switch tracking on).
    for path, node in _walk(crd.openapi_schema()):
        if isinstance(node.get("default"), dict):
            assert set(node.get("required", [])) <= set(node["default"]), path
        if node.get("nullable"):
            assert "default" not in node, path


def test_every_field_has_a_description_for_kubectl_explain() -> None:
    spec = crd.openapi_schema()["properties"]["spec"]
    missing = [
        f"{path}.{name}"
        for path, node in _walk(spec)
        for name, prop in node.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert missing == []


def test_every_status_field_is_in_the_schema_so_nothing_is_pruned() -> None:
    status_schema = crd.openapi_schema()["properties"]["status"]["properties"]
    for field in api.FSDPTrainingRunStatus.model_fields.values():
        assert field.alias in status_schema, field.alias


def test_condition_type_docs_name_every_condition_the_operator_sets() -> None:
    described = crd.openapi_schema()["properties"]["status"]["properties"]["conditions"]["items"]
    doc = described["properties"]["type"]["description"]
    types = [value for name, value in vars(conditions).items() if name.isupper() and isinstance(value, str)]
    assert len(types) >= 9 and [t for t in types if t not in doc] == []


def test_printer_columns_give_the_daily_view() -> None:
    version = crd.crd_manifest()["spec"]["versions"][0]
    normal = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority")]
    assert normal == ["Phase", "Step", "Loss", "Last Checkpoint", "Restarts", "Age", "Message"]
    assert wide == [
        "Image Digest",
        "Ray Cluster",
        "Transport",
        "Bus GB/s",
        "Progress %",
        "ETA",
        "Goodput",
        "GPU-h",
        "Cost USD",
    ]
    assert "trainingruns" in crd.crd_manifest()["spec"]["names"]["shortNames"]


def test_the_kubectl_plugin_names_the_resource_the_crd_has() -> None:
    # The plugin reads runs through kubectl, by the resource's full name (the phases a run ends in it takes
    # from the API models, through the client's log follower).
    names = crd.crd_manifest()["spec"]["names"]
    assert f"{names['plural']}.{crd.crd_manifest()['spec']['group']}" == cli.RESOURCE


def test_trainer_config_sections_are_the_contract_models() -> None:
    # One source of truth: the CRD's spec.training is the trainer's TrainingSpec, field for field.
    from fsdp_trainer.contract import TrainingSpec

    schema = yaml.safe_load(crd.render())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    training = schema["properties"]["spec"]["properties"]["training"]["properties"]
    assert set(training) == {f.alias for f in TrainingSpec.model_fields.values()}


def test_every_spec_string_list_and_map_is_bounded_so_cel_costs_stay_within_budget() -> None:
    spec = crd.openapi_schema()["properties"]["spec"]
    unbounded = [
        path
        for path, node in _walk(spec)
        if (node.get("type") == "string" and "enum" not in node and "maxLength" not in node)
        or (node.get("type") == "array" and "maxItems" not in node)
        or (node.get("type") == "object" and "additionalProperties" in node and "maxProperties" not in node)
    ]
    assert unbounded == []


def test_pydantic_refuses_what_the_apiserver_refuses() -> None:
    base = {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}}
    refused = [
        {"runtimeEnv": {"env": {"LD_PRELOAD": "/x.so"}}},
        {"runtimeEnv": {"env": {"AWS_REGION": "us-east-1"}}},
        {"runtimeEnv": {"pip": ["--index-url https://evil.example"]}},
        {"runtimeEnv": {"pip": ["git+https://evil.example/x.git"]}},
        {"network": {"ncclEnv": {"PYTHONPATH": "/tmp"}}},
        {"data": {"source": "s3://b/\u202ex"}},
        {"cluster": {"cpu": "lots"}},
        {"runtimeEnv": {"secretEnv": {"LD_PRELOAD": {"name": "s", "key": "k"}}}},
        {"runtimeEnv": {"env": {"HF_TOKEN": "x"}, "secretEnv": {"HF_TOKEN": {"name": "s", "key": "k"}}}},
        {"runtimeEnv": {"secretEnv": {"HF_TOKEN": {"name": "Bad_Name", "key": "k"}}}},
        {"tracking": {"mlflow": {"trackingUri": "file:///tmp/mlruns"}}},
        {"tracking": {"mlflow": {"trackingUri": "https://user:secret@mlflow.example.com"}}},
        {
            "tracking": {
                "mlflow": {"trackingUri": "http://m", "credentials": {"username": {"name": "s", "key": "u"}}}
            }
        },
        {
            "tracking": {"mlflow": {"trackingUri": "http://m"}},
            "runtimeEnv": {"secretEnv": {"MLFLOW_TRACKING_TOKEN": {"name": "s", "key": "k"}}},
        },
    ]
    for change in refused:
        try:
            api.FSDPTrainingRunSpec.model_validate({**base, **change})
        except ValueError:
            continue
        raise AssertionError(f"accepted: {change}")
    accepted = {"runtimeEnv": {"env": {"FSDP_TRAINER_FAULT": "x"}, "pip": ["transformers[torch]>=4.40,<5"]}}
    api.FSDPTrainingRunSpec.model_validate(
        {**base, **accepted, "network": {"ncclEnv": {"NCCL_DEBUG": "INFO"}}}
    )
