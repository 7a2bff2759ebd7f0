"""What a tenant writes reaches the operator bounded: each object of the run's prefix, the listing of its
checkpoints, every trainer-written field of the status, model.fromConfig; the plugin prints it inert. A
hostile object costs its own run a condition that names it, never the operator's memory or other runs' passes.

No servers here: S3 is an in-process stand-in that hands out bytes lazily and counts what it handed out (the
same reads against a real S3 API and the dashboard's HTTP are in tests/cluster/test_tenant_bounds.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import gc
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError
from pydantic import ValidationError

from fsdp_operator import api, conditions, submission
from fsdp_operator.builder import RunRef
from fsdp_operator.reconcile import MAX_EVIDENCE_LINES, MAX_TRAINER_TEXT, Observation, reconcile
from fsdp_operator.records import (
    MANIFEST_BYTES_PER_PASS,
    MAX_LIST_PAGES,
    MAX_RECORD_BYTES,
    STACKS_BYTES_PER_PASS,
    RecordTooLarge,
    RunStorage,
)
from fsdp_operator.statuspatch import merge_patch
from fsdp_trainer import runlog
from fsdp_trainer.contract import (
    MANIFEST_FILE,
    MAX_FROM_CONFIG_BYTES,
    MAX_FROM_CONFIG_DEPTH,
    MLFLOW_RUN_FILE,
    PROGRESS_FILE,
    RUN_RECORD_FILE,
    MlflowRunRef,
    ModelSpec,
    ProgressRecord,
    TransportReport,
    Versions,
)
from kubectl_trainingrun import cli
from tests.support.process_usage import memory_kib, reset_peak

NOW = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC)
GIB = 1 << 30
URI = "s3://tenant-bucket/runs/team-b/hostile"


class LazyBody:
    """An object's body of `size` bytes that exist only as they are read; counts what was read."""

    def __init__(self, head: bytes, size: int) -> None:
        self.head, self.size, self.handed = head, size, 0

    def read(self, amount: int | None = None) -> bytes:
        amount = self.size - self.handed if amount is None else min(amount, self.size - self.handed)
        if amount > 256 << 20:
            raise MemoryError(f"asked for {amount} bytes at once")
        start, self.handed = self.handed, self.handed + amount
        data = self.head[start : start + amount]
        return data + b" " * (amount - len(data))

    def close(self) -> None:
        pass


class TenantS3:
    """boto3's S3 client as the operator calls it, over objects of any size (Range honoured as S3 does) and a
    listing of any length; records every request."""

    class exceptions:  # as boto3's client.exceptions
        class NoSuchKey(Exception):
            pass

        ClientError = ClientError

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.bodies: list[LazyBody] = []
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.listed: Iterator[int] | None = None  # an endless listing when set: keys per page

    def put(self, key: str, head: bytes, size: int | None = None) -> None:
        self.objects[key] = (head, len(head) if size is None else size)

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        self.requests.append(("get_object", {"Key": Key, "Range": Range}))
        if Key not in self.objects:
            raise self.exceptions.NoSuchKey(Key)
        head, size = self.objects[Key]
        answer: dict[str, Any] = {}
        if Range is not None:
            first, last = (int(x) for x in Range.removeprefix("bytes=").split("-"))
            length = min(last, size - 1) - first + 1
            answer["ContentRange"] = f"bytes {first}-{first + length - 1}/{size}"
        else:
            length = size
        body = LazyBody(head, length)
        self.bodies.append(body)
        return {**answer, "Body": body, "ContentLength": length}

    def list_objects_v2(self, **request: Any) -> dict[str, Any]:
        self.requests.append(("list_objects_v2", request))
        page = len([r for r in self.requests if r[0] == "list_objects_v2"])
        keys = request["MaxKeys"]
        contents = [
            {"Key": f"{request['Prefix']}{page}-{i}/shard", "Size": 1} for i in range(keys)
        ]  # a prefix of millions of objects: every page full, always another one
        return {"Contents": contents, "IsTruncated": True, "NextContinuationToken": f"t{page}"}

    def get_paginator(self, operation: str) -> Any:
        """boto3's paginator over list_objects_v2: follows the continuation tokens for as long as there are
        pages (here stopped, as a failure, at 100 times the operator's cap)."""
        client = self

        class Paginator:
            def paginate(self, **request: Any) -> Iterator[dict[str, Any]]:
                for _ in range(100 * MAX_LIST_PAGES):
                    page = client.list_objects_v2(**{"MaxKeys": 1000, **request})
                    yield page
                    if not page.get("IsTruncated"):
                        return
                    request["ContinuationToken"] = page["NextContinuationToken"]
                raise AssertionError(f"listed {100 * MAX_LIST_PAGES} pages in one pass")

        assert operation == "list_objects_v2"
        return Paginator()

    def read_bytes(self) -> int:
        return sum(body.handed for body in self.bodies)


def progress_json(**fields: Any) -> bytes:
    record = {"runName": "hostile", "phase": "training", "maxSteps": 100, "updatedAt": NOW.isoformat()}
    return json.dumps({**record, **fields}).encode()


# -- objects of the run's prefix ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "read"),
    [
        (PROGRESS_FILE, RunStorage.progress),
        (MLFLOW_RUN_FILE, RunStorage.mlflow_run),
        (RUN_RECORD_FILE, lambda storage: storage.read_run_restarts("uid")),
    ],
)
def test_a_multi_gigabyte_record_is_refused_after_reading_its_cap_naming_object_and_cap(
    name: str, read: Any
) -> None:
    s3 = TenantS3()
    s3.put(f"runs/team-b/hostile/{name}", progress_json(), size=5 * GIB)
    with pytest.raises(RecordTooLarge) as refused:
        read(RunStorage(s3, URI))
    cap = MAX_RECORD_BYTES[name]
    assert s3.read_bytes() <= cap + 1  # not 5 GiB: the operator's memory is not the tenant's to spend
    assert f"{URI}/{name}" in str(refused.value) and str(cap) in str(refused.value)
    assert str(5 * GIB) in str(refused.value)  # the object's size, as S3 tells it


def test_a_record_within_its_cap_is_read_as_before() -> None:
    s3 = TenantS3()
    s3.put(f"runs/team-b/hostile/{PROGRESS_FILE}", progress_json(step=7))
    record = RunStorage(s3, URI).progress()
    assert record is not None and record.step == 7


def peak_growth_kib(work: Callable[[], object]) -> int:
    """How far this process's peak resident memory (the kernel's VmHWM) rose above its size while `work` ran:
    what the allocator's Python and native parts (pydantic's errors) took together."""
    gc.collect()
    before = reset_peak(os.getpid())
    work()
    return memory_kib(os.getpid(), "VmHWM") - before


def test_a_run_record_of_any_shape_under_its_cap_costs_its_parse_not_an_error_per_key() -> None:
    """run.json is read back for its uid and restarts (once per run and operator start). One just under its
    cap with keys no record has costs about what parsing it does, where validating it whole cost a validation
    error per key (+150 MiB for a 4 MiB one): keys beside the restarts are not read, and a restart entry with
    them makes the restarts unreadable (none carried over)."""
    cap = MAX_RECORD_BYTES[RUN_RECORD_FILE]
    entry = {"time": NOW.isoformat(), "reason": "JobFailed"}
    junk = {f"k{i:06x}": 0 for i in range((cap - 200) // 14)}  # 14 bytes a key: just under the cap
    shapes = {
        "beside the restarts": ({"uid": "uid", "restarts": [entry], **junk}, ["JobFailed"]),
        "in a restart entry": ({"uid": "uid", "restarts": [entry, {**entry, **junk}]}, None),
    }
    for shape, (record, carried) in shapes.items():
        body = json.dumps(record).encode()
        assert len(body) <= cap, len(body)
        s3 = TenantS3()
        s3.put(f"runs/team-b/hostile/{RUN_RECORD_FILE}", body)
        storage = RunStorage(s3, URI)
        parse = peak_growth_kib(functools.partial(json.loads, body))
        read = peak_growth_kib(functools.partial(storage.read_run_restarts, "uid"))
        assert read < 2 * parse + 4096, f"{shape}: reading it took {read} KiB, parsing it {parse} KiB"
        restarts = storage.read_run_restarts("uid")
        assert (restarts if restarts is None else [r.reason for r in restarts]) == carried, shape
    not_this_runs = [  # (record, the uid asked for)
        ({"uid": "uid", "restarts": [entry]}, "another run's uid"),
        ([entry], "uid"),
        ({"uid": "uid", "restarts": {"0": entry}}, "uid"),
    ]
    for record, uid in not_this_runs:
        s3 = TenantS3()
        s3.put(f"runs/team-b/hostile/{RUN_RECORD_FILE}", json.dumps(record).encode())
        assert RunStorage(s3, URI).read_run_restarts(uid) is None, record


def test_a_record_nested_past_pythons_parser_is_refused_not_raised_as_a_recursion() -> None:
    s3 = TenantS3()
    s3.put(f"runs/team-b/hostile/{PROGRESS_FILE}", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(RecordTooLarge, match="nested too deeply"):
        RunStorage(s3, URI).progress()


def test_a_giant_checkpoint_manifest_is_refused_naming_it() -> None:
    s3 = TenantS3()
    prefix = "runs/team-b/hostile/checkpoint_000001/"
    s3.list_objects_v2 = lambda **request: {  # type: ignore[method-assign]
        "Contents": [
            {"Key": prefix + MANIFEST_FILE, "Size": 3 * GIB},
            {"Key": prefix + ".metadata", "Size": 1},
        ]
    }
    s3.put(prefix + MANIFEST_FILE, b"{}", size=3 * GIB)
    with pytest.raises(RecordTooLarge, match=f"{MANIFEST_FILE}.*{MAX_RECORD_BYTES[MANIFEST_FILE]}"):
        RunStorage(s3, URI).complete_checkpoints()
    assert s3.read_bytes() <= MAX_RECORD_BYTES[MANIFEST_FILE] + 1


def manifest_json(step: int, files: dict[str, int]) -> bytes:
    manifest = {"runName": "hostile", "step": step, "tokensSeen": 0, "worldSize": 1,
                "createdAt": NOW.isoformat(), "files": files}  # fmt: skip
    return json.dumps(manifest).encode()


def listing_of(s3: TenantS3, prefix: str) -> None:
    """The stand-in lists what was put under `prefix`, in one page."""
    s3.list_objects_v2 = lambda **request: {  # type: ignore[method-assign]
        "Contents": [{"Key": k, "Size": size} for k, (_, size) in s3.objects.items() if k.startswith(prefix)]
    }


def test_manifests_of_checkpoints_never_completed_are_read_within_a_pass_budget_and_not_kept() -> None:
    """Issue 46: every manifest was kept for the run's life; a hundred just-under-1-MiB manifests of
    checkpoints that never complete took the operator past its memory limit, and again after its restart."""
    s3 = TenantS3()
    run = "runs/team-b/hostile/"
    cap = MAX_RECORD_BYTES[MANIFEST_FILE]
    for i in range(100):  # no DCP metadata: never complete
        s3.put(f"{run}checkpoint_{i:06d}/{MANIFEST_FILE}", manifest_json(i, {"x": 1}), size=cap - 1)
    listing_of(s3, run)
    storage = RunStorage(s3, URI)
    with pytest.raises(RecordTooLarge, match="add up to more than the operator reads in a pass"):
        storage.complete_checkpoints()
    assert s3.read_bytes() <= MANIFEST_BYTES_PER_PASS < 10 * cap, s3.read_bytes()  # of 100 MiB written
    assert storage._complete == {}, "something was kept of a checkpoint that is not complete"


def test_a_complete_checkpoints_manifest_is_read_once_and_only_its_summary_kept() -> None:
    s3 = TenantS3()
    run = "runs/team-b/hostile/"
    s3.put(f"{run}checkpoint_000005/{MANIFEST_FILE}", manifest_json(5, {".metadata": 1, "shard": 3}))
    s3.put(f"{run}checkpoint_000005/.metadata", b"m")
    s3.put(f"{run}checkpoint_000005/shard", b"abc")
    listing_of(s3, run)
    storage = RunStorage(s3, URI)
    [first] = storage.complete_checkpoints()
    read = s3.read_bytes()
    [again] = storage.complete_checkpoints()
    assert (first.ref.step, again) == (5, first) and s3.read_bytes() == read
    s3.objects[f"{run}checkpoint_000005/shard"] = (b"ab", 2)  # a file shrank: judged again, incomplete
    assert storage.complete_checkpoints() == [] and storage._complete == {}


def test_the_ranks_forensics_answers_are_read_within_a_pass_budget() -> None:
    s3 = TenantS3()
    cap = MAX_RECORD_BYTES["rank-*.json"]
    keys = [f"runs/team-b/hostile/forensics/attempt-1/rank-{i}.json" for i in range(100)]
    for key in keys:
        s3.put(key, b"{}", size=cap - 1)
    assert RunStorage(s3, URI).rank_stacks(keys) == []
    assert s3.read_bytes() <= STACKS_BYTES_PER_PASS + cap < 20 * cap, s3.read_bytes()  # of 100 MiB written


def test_a_prefix_of_millions_of_objects_costs_a_bounded_number_of_list_requests() -> None:
    s3 = TenantS3()
    with pytest.raises(RecordTooLarge) as refused:
        RunStorage(s3, URI).complete_checkpoints()
    lists = [request for kind, request in s3.requests if kind == "list_objects_v2"]
    assert len(lists) == MAX_LIST_PAGES
    assert all(r["MaxKeys"] <= 1000 for r in lists)
    # Only the checkpoint directories are listed: logs, metrics and the model beside them are never paged.
    assert {r["Prefix"] for r in lists} == {"runs/team-b/hostile/checkpoint_"}
    assert "runs/team-b/hostile/checkpoint_*" in str(refused.value) and "20000" in str(refused.value)


def test_an_oversized_record_is_its_runs_condition_and_event_naming_it() -> None:
    message = f"{URI}/{PROGRESS_FILE} is {5 * GIB} bytes, over the operator's cap of 262144 bytes"
    spec = api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://tenant-bucket/runs"}}
    )
    running = api.FSDPTrainingRunStatus(phase=api.Phase.RUNNING, attempt=1, job_submission_id="hostile-1")
    obs = Observation(
        now=NOW,
        generation=1,
        cluster=None,
        storage_read=True,
        storage_error=message,
        storage_error_reason=RecordTooLarge.reason,
    )
    decision = reconcile(spec, running, obs)
    readable = conditions.condition(decision.status.conditions, conditions.STORAGE_READABLE)
    assert readable is not None and (readable.status, readable.reason) == ("False", "RecordTooLarge")
    assert message in readable.message
    assert [(e.type, e.reason) for e in decision.events if "progress.json" in e.message] == [
        ("Warning", "RecordTooLarge")
    ]
    again = reconcile(spec, decision.status, obs)
    assert not [e for e in again.events if e.reason == "RecordTooLarge"]  # said once, not every pass


# -- trainer-written fields of the status -------------------------------------------------------------------


def test_every_trainer_written_status_field_is_bounded() -> None:
    """progress.json within its 256 KiB cap still holds text enough to fill a status past etcd's limit over
    a few fields; and mlflow.json may name any server. What enters the status is bounded: text cut with a
    marker, a URI or id that is only useful whole left out, counts clamped to int64, NaN left out."""
    huge = "\x1b]0;owned\x07" + "e" * 100_000
    progress = ProgressRecord(
        run_name="hostile",
        phase="training",
        step=10**30,
        max_steps=100,
        loss=float("nan"),
        updated_at=NOW,
        versions=Versions(torch=huge, cuda="12.4"),
        exported_model_uri="s3://tenant-bucket/" + "m" * 5000,
        transport=TransportReport(observed="socket", evidence=[huge] * 1000, bus_bandwidth_gbps=float("inf")),
    )
    spec = api.FSDPTrainingRunSpec.model_validate(
        {
            "model": {"source": "m"},
            "checkpoint": {"storagePath": "s3://tenant-bucket/runs"},
            "tracking": {"mlflow": {"trackingUri": "https://mlflow.example"}},
        }
    )
    running = api.FSDPTrainingRunStatus(
        phase=api.Phase.RUNNING,
        attempt=1,
        job_submission_id="hostile-1",
        record=api.RecordStatus(exported_model_uri="s3://tenant-bucket/runs/team-b/hostile/model"),
    )
    elsewhere = MlflowRunRef(
        tracking_uri="https://phish.example", experiment_id="1", run_id="r", submission_id="hostile-1"
    )
    obs = Observation(now=NOW, generation=1, cluster=None, progress=progress, mlflow_run=elsewhere)
    new = reconcile(spec, running, obs).status
    status = new.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert len(json.dumps(status)) < 16_000  # the whole status, from ~100 MB of trainer text
    assert new.transport is not None
    assert len(new.transport.evidence) == MAX_EVIDENCE_LINES + 1
    assert new.transport.evidence[-1].endswith(f"{1000 - MAX_EVIDENCE_LINES} more lines")
    assert all(len(line) <= MAX_TRAINER_TEXT for line in new.transport.evidence)
    assert new.transport.evidence[0].endswith("...[truncated]") and "\x1b" not in new.transport.evidence[0]
    assert new.transport.bus_bandwidth_gbps is None
    assert new.record.versions.torch is not None and new.record.versions.torch.endswith("...[truncated]")
    assert new.record.versions.cuda == "12.4"
    assert new.record.exported_model_uri == "s3://tenant-bucket/runs/team-b/hostile/model"  # refused: kept
    assert new.record.mlflow_run is None  # another server than the spec's: no link to it in the status
    assert new.progress.step == 2**63 - 1 and new.progress.loss is None
    message = conditions.condition(new.conditions, conditions.TRANSPORT_DEGRADED)
    assert message is not None and len(message.message) <= api.MAX_MESSAGE
    assert merge_patch({}, status)  # a patch the status subresource takes (JSON, no NaN)
    json.dumps(status, allow_nan=False)


def test_a_plausible_mlflow_run_is_linked() -> None:
    spec = api.FSDPTrainingRunSpec.model_validate(
        {
            "model": {"source": "m"},
            "checkpoint": {"storagePath": "s3://b/runs"},
            "tracking": {"mlflow": {"trackingUri": "https://mlflow.example"}},
        }
    )
    ref = MlflowRunRef(
        tracking_uri="https://mlflow.example", experiment_id="3", run_id="abc", submission_id="s-1"
    )
    obs = Observation(now=NOW, generation=1, cluster=None, mlflow_run=ref)
    new = reconcile(spec, api.FSDPTrainingRunStatus(phase=api.Phase.RUNNING), obs).status
    assert new.record.mlflow_run is not None and new.record.mlflow_run.run_id == "abc"


# -- model.fromConfig ----------------------------------------------------------------------------------------


def nested(depth: int) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": "qwen2"}
    for _ in range(depth - 1):
        config = {"model_type": "qwen2", "sub": config}
    return config


def test_a_1500_deep_from_config_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError) as refused:
        api.FSDPTrainingRunSpec.model_validate(
            {
                "model": {"fromConfig": nested(1500), "tokenizer": "byte-level"},
                "checkpoint": {"storagePath": "s3://b/p"},
            }
        )
    said = str(refused.value)
    assert "spec.model.fromConfig" in said and f"{MAX_FROM_CONFIG_DEPTH} levels" in said


def test_from_config_depth_and_size_bounds() -> None:
    assert ModelSpec(from_config=nested(MAX_FROM_CONFIG_DEPTH)).from_config is not None
    with pytest.raises(ValidationError, match=r"spec\.model\.fromConfig is nested deeper"):
        ModelSpec(from_config=nested(MAX_FROM_CONFIG_DEPTH + 1))
    with pytest.raises(ValidationError, match=r"spec\.model\.fromConfig is nested deeper"):
        ModelSpec(from_config={"model_type": "x", "layers": [[[[[[[[1]]]]]]]]})  # lists count as levels
    padding = "x" * MAX_FROM_CONFIG_BYTES
    with pytest.raises(ValidationError, match=f"more than {MAX_FROM_CONFIG_BYTES} bytes"):
        ModelSpec(from_config={"model_type": "x", "padding": padding})
    real = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "rope_scaling": {"type": "yarn", "factor": 4.0},
        "text_config": {"rope_scaling": {"type": "linear", "factor": 2.0}},
        "id2label": {"0": "LABEL_0"},
    }
    assert ModelSpec(from_config=real).from_config == real


# -- redaction and the plugin --------------------------------------------------------------------------------


def test_mlflow_credentials_are_redacted_from_the_trainers_logs() -> None:
    spec = api.FSDPTrainingRunSpec.model_validate(
        {
            "model": {"source": "m"},
            "checkpoint": {"storagePath": "s3://b/p"},
            "tracking": {
                "mlflow": {
                    "trackingUri": "https://mlflow.example",
                    "credentials": {
                        "token": {"name": "mlflow", "key": "token"},
                        "username": {"name": "mlflow", "key": "user"},
                        "password": {"name": "mlflow", "key": "password"},
                    },
                }
            },
        }
    )
    config = submission.trainer_config(spec, RunRef("r", "team-a", "uid"), cpu_only=True)
    environ = {
        "MLFLOW_TRACKING_TOKEN": "tok-7f3a9c",
        "MLFLOW_TRACKING_USERNAME": "svc-trainer",
        "MLFLOW_TRACKING_PASSWORD": "pw-91ab",
    }
    redact = runlog.Redactor(config.secret_env_names, environ)
    said = redact("Authorization: Bearer tok-7f3a9c as svc-trainer:pw-91ab")
    assert all(value not in said for value in environ.values()), said
    assert "[MLFLOW_TRACKING_TOKEN redacted]" in said


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e"


def test_describe_prints_tenant_text_inert_and_on_its_own_line() -> None:
    run = {
        "metadata": {"name": "hostile", "namespace": "team-b"},
        "spec": {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/runs"}},
        "status": {
            "phase": "Running",
            "message": f"step 3{ESCAPES}\nCondition:     Succeeded=True",
            "record": {"versions": {"torch": f"2.5{ESCAPES}"}, "exportedModelUri": f"s3://b/m{ESCAPES}"},
            "transport": {"observed": "socket", "evidence": [ESCAPES]},
            "conditions": [
                {"type": "Failed", "status": "True", "reason": "Bad", "message": f"x{ESCAPES}\ty"}
            ],
        },
    }
    shown = cli.describe(run)
    for control in ("\x1b", "\x07", "\x9b", "\u202e", "\t"):
        assert control not in shown
    assert "\\x1b]0;pwned\\x07" in shown  # escaped, still readable
    assert not any(line.startswith("Condition:     Succeeded") for line in shown.splitlines())


def test_logs_and_errors_reach_the_terminal_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    cli.to_terminal(f"line one{ESCAPES}\nline two\r\n\tindented\rprogress 50%\n")
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "line one\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\u202e",
        "line two",
        "\tindented",
        "progress 50%",
    ]


def test_status_messages_and_events_quoting_tenant_text_are_inert() -> None:
    """Issue 46: a run's message kept ESC (and C1 CSI) from Ray's job message, so `kubectl get trainingruns`
    printed the tenant's terminal escapes."""
    from tests.support.decision_inputs import job, observe, spec, status

    failed = dataclasses.replace(job("FAILED"), message=f"boom{ESCAPES}\tat step 3")
    decision = reconcile(spec(recovery={"maxRestarts": 0}), status(), observe(job=failed))
    texts = [decision.status.message or "", *(c.message for c in decision.status.conditions)]
    texts += [conditions.bounded(event.message) for event in decision.events]  # as runpass.py sends them
    assert any("boom" in text for text in texts), texts
    for text in texts:
        assert not any(control in text for control in ("\x1b", "\x07", "\x9b", "\u202e", "\t")), text


def test_a_hung_ranks_names_in_status_forensics_are_bounded_and_inert() -> None:
    from fsdp_operator import hangs
    from fsdp_trainer.contract import RankStacks

    def rank(number: int, step: int) -> RankStacks:
        return RankStacks(
            rank=number, world_size=2, pod="p" * 100_000 + ESCAPES, node="n" * 100_000 + ESCAPES,
            step=step, in_collective=False, training_thread_top=f"frame{ESCAPES}" * 1000, written_at=NOW,
        )  # fmt: skip

    found = hangs.suspect([rank(0, 5), rank(1, 4)], world_size=2)
    assert found is not None and found.rank == 1
    for text in (found.pod or "", found.node or "", found.why):
        assert len(text) <= 1000 and "\x1b" not in text and "\u202e" not in text, text[-80:]
