"""Generates the FSDPTrainingRun CRD from the pydantic API models.

`python -m fsdp_operator.crd` rewrites crds/ and the Helm chart's copy; a unit test fails when either
differs from what the models generate. Pydantic's JSON Schema is turned into a Kubernetes structural
schema: $refs inlined, Optional as nullable, no additionalProperties: false, OpenAPI v3.0 exclusive bounds,
`default: {}` on optional objects so the apiserver applies nested defaults.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from fsdp_operator import api
from fsdp_trainer.contract import NCCL_ENV_NAME, ContractModel

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / f"{api.PLURAL}.{api.GROUP}.yaml"
CHART_CRD_FILE = REPO / "charts" / "fsdp-operator" / "crds" / CRD_FILE.name

_ACTIVE = "[" + ", ".join(f"'{p.value}'" for p in api.IMMUTABLE_PHASES) + "]"


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{value}'" for value in values) + "]"


# Cross-field rules on spec: (CEL, message, field path). The message names the field it is about.
SPEC_RULES: list[tuple[str, str, str]] = [
    (
        "self.checkpoint.storagePath.startsWith('s3://')",
        "spec.checkpoint.storagePath must be an s3:// URI: every node must reach the same checkpoints, "
        "and the operator reads progress and checkpoints there",
        ".checkpoint.storagePath",
    ),
    (
        "!self.checkpoint.storagePath.matches('(^|/)[.][.]?(/|$)')",
        "spec.checkpoint.storagePath must not contain . or .. segments: each run's prefix must stay under it",
        ".checkpoint.storagePath",
    ),
    *(
        (
            f"!has(self.runtimeEnv.{field}) || self.runtimeEnv.{field}.all(k, k.matches('{api.ENV_NAME}')"
            " && !(k.upperAscii() in " + _cel_list(api.RESERVED_ENV_NAMES) + ")"
            " && !" + _cel_list(api.RESERVED_ENV_PREFIXES) + ".exists(p, k.upperAscii().startsWith(p)))",
            f"spec.runtimeEnv.{field} names must be environment names and must not steer the runtime: "
            + ", ".join(api.RESERVED_ENV_NAMES)
            + ", "
            + ", ".join(p + "*" for p in api.RESERVED_ENV_PREFIXES)
            + " are refused (NCCL and libfabric settings go in spec.network.ncclEnv)",
            f".runtimeEnv.{field}",
        )
        for field in ("env", "secretEnv")
    ),
    (
        "!has(self.runtimeEnv.env) || !has(self.runtimeEnv.secretEnv)"
        " || !self.runtimeEnv.secretEnv.exists(k, k in self.runtimeEnv.env)",
        "spec.runtimeEnv.secretEnv names must not also be set in spec.runtimeEnv.env",
        ".runtimeEnv.secretEnv",
    ),
    *(
        (
            f"!has({path}) || {path}.all(k, k.size() <= 316 && k.matches('{api.LABEL_KEY}'))",
            f"spec{path.removeprefix('self')} keys must be label keys (optional DNS prefix/, then a name of "
            "at most 63 characters)",
            path.removeprefix("self"),
        )
        for path in ("self.cluster.nodeSelector", "self.cluster.head.nodeSelector")
    ),
    (
        "!has(self.network.ncclEnv) || self.network.ncclEnv.all(k, k.matches('" + NCCL_ENV_NAME + "'))",
        "spec.network.ncclEnv may set only NCCL_*, FI_* and OFI_* variables",
        ".network.ncclEnv",
    ),
    (
        "!has(self.network.ncclEnv) || !self.network.ncclEnv.exists(k, k in "
        + _cel_list(api.REFUSED_NCCL_ENV)
        + ")",
        f"spec.network.ncclEnv must not set {', '.join(api.REFUSED_NCCL_ENV)}: each loads a library",
        ".network.ncclEnv",
    ),
    *(
        (
            f"!has(self.{parent}) || !has(self.{field}) || !self.{field}.startsWith('s3://')"
            f" || self.{field}.matches('{api.S3_URI}')",
            f"spec.{field} must be an s3:// URI of a bucket and key segments of letters, digits and ._=- "
            "(characters such as ? # * % + and // are read differently by the libraries that open it)",
            f".{field}",
        )
        for field in api.S3_URI_FIELDS
        for parent in [field.split(".")[0]]
    ),
    (
        "!has(self.tracking) || !has(self.tracking.mlflow) || !has(self.tracking.mlflow.credentials)"
        " || has(self.tracking.mlflow.credentials.username)"
        " == has(self.tracking.mlflow.credentials.password)",
        "spec.tracking.mlflow.credentials username and password go together",
        ".tracking.mlflow.credentials",
    ),
    *(
        (
            f"!has(self.tracking) || !has(self.tracking.mlflow) || !has(self.runtimeEnv.{field})"
            f" || !self.runtimeEnv.{field}.exists(k, k.startsWith('{api.MLFLOW_ENV_PREFIX}'))",
            f"spec.runtimeEnv.{field}: with spec.tracking.mlflow, {api.MLFLOW_ENV_PREFIX}* credentials go in "
            "spec.tracking.mlflow.credentials",
            f".runtimeEnv.{field}",
        )
        for field in ("env", "secretEnv")
    ),
    (
        "self.fsdp.mixedPrecision != 'fp16'",
        "spec.fsdp.mixedPrecision fp16 is not supported: it needs loss scaling, which the trainer does "
        "not do (fp16 gradients underflow); use bf16 or fp32",
        ".fsdp.mixedPrecision",
    ),
    (
        "self.fsdp.sharding != 'HYBRID_SHARD' || self.cluster.workers >= 2",
        "spec.fsdp.sharding HYBRID_SHARD needs spec.cluster.workers >= 2 (it replicates across nodes)",
        ".fsdp.sharding",
    ),
    (
        "has(self.model.source) != has(self.model.fromConfig)",
        "spec.model needs exactly one of source and fromConfig",
        ".model",
    ),
    (
        "!has(self.model.fromConfig) || has(self.model.tokenizer)",
        "spec.model.tokenizer is required with spec.model.fromConfig (there is no source to take it from)",
        ".model.tokenizer",
    ),
    (
        "self.network.efa != 'required' || !has(self.cluster.efaPerWorker) || self.cluster.efaPerWorker >= 1",
        "spec.network.efa required needs spec.cluster.efaPerWorker >= 1",
        ".network.efa",
    ),
    (
        "!has(self.cluster.efaPerWorker) || self.cluster.efaPerWorker == 0 || self.network.efa != 'disabled'",
        "spec.cluster.efaPerWorker must be 0 when spec.network.efa is disabled",
        ".cluster.efaPerWorker",
    ),
    (
        "self.data.evalEvery <= self.training.maxSteps",
        "spec.data.evalEvery must not exceed spec.training.maxSteps",
        ".data.evalEvery",
    ),
    (
        "self.training.warmupSteps < self.training.maxSteps",
        "spec.training.warmupSteps must be less than spec.training.maxSteps",
        ".training.warmupSteps",
    ),
]

# Fields that may not change while a run is active or queued (a RayCluster of its shape exists). Suspend
# first, or create a new run. Rules sit at the root because they need status.phase. runtimeEnv.secretEnv and
# tracking need the namespace's grants (tenancy.py): an edit while active would reach the pods of a cluster
# rebuilt after a loss, or the next attempt's job.
IMMUTABLE_WHILE_ACTIVE = [
    "model",
    "image",
    "cluster",
    "fsdp",
    "training",
    "data",
    "checkpoint",
    "network",
    "runtimeEnv.secretEnv",
    "tracking",
]


def _root_rules() -> list[dict[str, Any]]:
    rules = []
    for field in IMMUTABLE_WHILE_ACTIVE:
        path = field.split(".")

        def present(root: str, path: list[str] = path) -> str:
            # has() of a nested field needs each parent present first
            return " && ".join(f"has({root}.spec.{'.'.join(path[: i + 1])})" for i in range(len(path)))

        rules.append(
            {
                "rule": "!has(oldSelf.status) || !has(oldSelf.status.phase)"
                f" || !(oldSelf.status.phase in {_ACTIVE})"
                f" || (({present('self')}) == ({present('oldSelf')})"
                f" && (!({present('self')}) || self.spec.{field} == oldSelf.spec.{field}))",
                "message": f"spec.{field} cannot change while the run is active (phase in {_ACTIVE}); "
                "suspend the run first or create a new one",
                "fieldPath": f".spec.{field}",
                "reason": "FieldValueForbidden",
            }
        )
    return rules


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Rewrites one pydantic JSON Schema node (and its children) as a structural schema node."""
    node = copy.deepcopy(schema)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        node = {**_structural(target, defs), **{k: v for k, v in node.items()}}
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"unions other than Optional[X] have no structural schema: {schema}")
        node = {**_structural(variants[0], defs), **node, "nullable": True}
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**_structural(node.pop("allOf")[0], defs), **node}
    node.pop("title", None)
    # A CRD schema has neither: map keys are checked by CEL rules (SPEC_RULES), values stay bounded.
    node.pop("propertyNames", None)
    if "patternProperties" in node:
        (values,) = node.pop("patternProperties").values()
        node["additionalProperties"] = values
    if "default" in node and node["default"] is None:
        node.pop("default")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node.get(bound), bool):
            node[inclusive] = node[bound]
            node[bound] = True
    if node.get("additionalProperties") in (False, True):
        node.pop("additionalProperties")
    if node.get("format") == "date-time":
        node["type"] = "string"
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"], defs)
    if "items" in node:
        node["items"] = _structural(node["items"], defs)
    if "properties" in node:
        node["type"] = "object"
        required = set(node.get("required", []))
        props = {}
        for name, prop in node["properties"].items():
            child = _structural(prop, defs)
            optional_with_defaults = name not in required and not child.get("nullable")
            if child.get("type") == "object" and "properties" in child and optional_with_defaults:
                child.setdefault("default", {})
            props[name] = child
        node["properties"] = props
    if node.get("x-kubernetes-preserve-unknown-fields"):
        node["type"] = "object"
        node.pop("additionalProperties", None)
    return node


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def openapi_schema() -> dict[str, Any]:
    def structural_of(model: type[ContractModel]) -> dict[str, Any]:
        raw = model.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
        return _structural(raw, raw.get("$defs", {}))

    spec = structural_of(api.FSDPTrainingRunSpec)
    spec["x-kubernetes-validations"] = [
        {"rule": rule, "message": message, "fieldPath": path} for rule, message, path in SPEC_RULES
    ]
    status = _without_defaults(structural_of(api.FSDPTrainingRunStatus))
    for schema in (spec, status):
        schema.pop("$defs", None)
    status["description"] = "Observed state, written by the operator through the status subresource."
    spec["description"] = "Desired state of the training run."
    return {
        "type": "object",
        "description": "A fine-tuning run with FSDP2 on a KubeRay RayCluster, restarted from its last "
        "complete checkpoint on failure.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": _root_rules(),
    }


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {"name": "Last Checkpoint", "type": "integer", "jsonPath": ".status.checkpoints.latest.step"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts.count"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # Why a run waits or ended, in the daily view (the scheduler's message for a worker with no node).
    {"name": "Message", "type": "string", "jsonPath": ".status.message"},
    {"name": "Image Digest", "type": "string", "jsonPath": ".status.image.digest", "priority": 1},
    {"name": "Ray Cluster", "type": "string", "jsonPath": ".status.rayClusterName", "priority": 1},
    {"name": "Transport", "type": "string", "jsonPath": ".status.transport.observed", "priority": 1},
    {
        "name": "Bus GB/s",
        "type": "number",
        "jsonPath": ".status.fabric.report.busBandwidthGbps",
        "priority": 1,
    },
    {"name": "Progress %", "type": "number", "jsonPath": ".status.goodput.progressPercent", "priority": 1},
    {"name": "ETA", "type": "string", "jsonPath": ".status.goodput.eta", "priority": 1},
    {"name": "Goodput", "type": "number", "jsonPath": ".status.goodput.fraction", "priority": 1},
    {"name": "GPU-h", "type": "number", "jsonPath": ".status.goodput.gpuHoursHeld", "priority": 1},
    {"name": "Cost USD", "type": "number", "jsonPath": ".status.goodput.costUsd", "priority": 1},
]


def crd_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": api.SHORT_NAMES,
                "categories": ["training"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `python -m fsdp_operator.crd` from fsdp_operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


def main() -> None:
    text = render()
    for path in (CRD_FILE, CHART_CRD_FILE):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
