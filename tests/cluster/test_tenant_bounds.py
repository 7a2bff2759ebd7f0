"""What a tenant writes, read by the operator from real servers: an S3 API (the local cluster's, or a moto
server of the test's own) and a hostile Ray head's HTTP. Each read costs the operator a bounded number of
bytes and requests, and a clear refusal naming what and the cap; a normal read next to it works as before."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest

from fsdp_operator import jobclient, records
from fsdp_operator.builder import LABEL_RUN
from fsdp_operator.jobclient import MAX_RESPONSE_BYTES, ResponseTooLarge
from fsdp_operator.jobs import MAX_JOB_FIELD, MAX_JOB_MESSAGE, Jobs
from fsdp_operator.records import MAX_RECORD_BYTES, RecordTooLarge, RunStorage
from fsdp_trainer.contract import MANIFEST_FILE, PROGRESS_FILE
from tests.support.kube import apply, kubectl
from tests.support.manifests import example
from tests.support.operator_process import OperatorProcess
from tests.support.process_usage import memory_kib
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.waiting import wait_until

MIB = 1 << 20


def s3_run(storage: str) -> tuple[Any, str, str]:
    """(the client, the bucket, the run's key prefix) of a run under `storage`."""
    bucket = storage.removeprefix("s3://").split("/")[0]
    return boto3.client("s3"), bucket, f"runs/team-b/run-{uuid.uuid4().hex[:6]}/"


def test_a_progress_record_over_its_cap_is_refused_with_its_size_and_a_normal_one_is_read(
    s3_storage: str,
) -> None:
    s3, bucket, prefix = s3_run(s3_storage)
    cap = MAX_RECORD_BYTES[PROGRESS_FILE]
    record = {
        "runName": "r",
        "phase": "training",
        "step": 5,
        "maxSteps": 10,
        "updatedAt": "2026-12-03T12:00:00Z",
    }
    padded = json.dumps({**record, "error": "x" * (3 * MIB)}).encode()
    s3.put_object(Bucket=bucket, Key=prefix + PROGRESS_FILE, Body=padded)
    storage = RunStorage(s3, f"s3://{bucket}/{prefix}")
    with pytest.raises(RecordTooLarge) as refused:
        storage.progress()
    said = str(refused.value)
    assert f"s3://{bucket}/{prefix}{PROGRESS_FILE}" in said
    assert f"{len(padded)} bytes" in said and f"cap of {cap} bytes" in said

    s3.put_object(Bucket=bucket, Key=prefix + PROGRESS_FILE, Body=json.dumps(record).encode())
    progress = storage.progress()
    assert progress is not None and progress.step == 5
    s3.put_object(Bucket=bucket, Key=prefix + PROGRESS_FILE, Body=b"")  # empty: unreadable, as before
    with pytest.raises(ValueError):
        storage.progress()


def test_the_checkpoints_listing_stops_at_its_page_cap_and_lists_only_checkpoints(
    s3_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "LIST_PAGE_KEYS", 4)
    monkeypatch.setattr(records, "MAX_LIST_PAGES", 2)
    s3, bucket, prefix = s3_run(s3_storage)
    checkpoint = f"{prefix}checkpoint_000001/"
    manifest = {
        "runName": "r",
        "step": 10,
        "tokensSeen": 1,
        "worldSize": 1,
        "createdAt": "2026-12-03T12:00:00Z",
        "files": {"__0_0.distcp": 3},
    }
    s3.put_object(Bucket=bucket, Key=checkpoint + MANIFEST_FILE, Body=json.dumps(manifest).encode())
    s3.put_object(Bucket=bucket, Key=checkpoint + ".metadata", Body=b"m")
    s3.put_object(Bucket=bucket, Key=checkpoint + "__0_0.distcp", Body=b"abc")
    for i in range(20):  # logs beside the checkpoints: never listed
        s3.put_object(Bucket=bucket, Key=f"{prefix}logs/attempt-1/rank-{i}.log", Body=b"l")
    storage = RunStorage(s3, f"s3://{bucket}/{prefix}")
    [found] = storage.complete_checkpoints()
    assert found.ref.step == 10

    for i in range(6):  # 9 objects under checkpoint_*: more than 2 pages of 4
        s3.put_object(Bucket=bucket, Key=f"{prefix}checkpoint_junk/{i}", Body=b"j")
    with pytest.raises(RecordTooLarge, match=r"checkpoint_\* holds more than 8 objects"):
        storage.complete_checkpoints()


def test_an_unchanged_progress_record_costs_a_304_without_a_body_and_a_changed_one_is_read(
    s3_storage: str,
) -> None:
    """A quiet run's progress.json is asked for at every pass: the S3 server answers Not Modified, with no
    body, and the operator keeps the record it parsed last; a rewrite is read at the next pass."""
    s3, bucket, prefix = s3_run(s3_storage)
    answers: list[tuple[int, int]] = []  # (HTTP status, body bytes the server sent) of each GetObject

    def heard(http_response: Any, **_: Any) -> None:
        answers.append((http_response.status_code, int(http_response.headers.get("Content-Length", 0))))

    s3.meta.events.register("after-call.s3.GetObject", heard)
    key = prefix + PROGRESS_FILE

    def write(step: int) -> int:
        record = {
            "runName": "r",
            "phase": "training",
            "step": step,
            "maxSteps": 10,
            "updatedAt": "2026-12-03T12:00:00Z",
        }
        body = json.dumps(record).encode()
        s3.put_object(Bucket=bucket, Key=key, Body=body)
        return len(body)

    size = write(5)
    storage = RunStorage(s3, f"s3://{bucket}/{prefix}")
    first = storage.progress()
    assert first is not None and first.step == 5 and answers[-1] == (206, size)

    assert storage.progress() is first, "an unchanged record is not parsed again"
    assert answers[-1] == (304, 0), f"the second read of an unchanged record was answered {answers[-1]}"

    size = write(6)
    changed = storage.progress()
    assert changed is not None and changed.step == 6 and answers[-1] == (206, size)

    s3.delete_object(Bucket=bucket, Key=key)
    assert storage.progress() is None
    write(7)
    again = storage.progress()
    assert again is not None and again.step == 7


class HostileHead(ThreadingHTTPServer):
    """A Ray head that runs the tenant's code: answers a job's status with an endless JSON body (streamed,
    up to `limit` bytes), a driver log without end, and anything else as Ray does. Counts what it sent."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), HostileHandler)
        self.sent = 0
        self.limit = 256 * MIB

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class HostileHandler(BaseHTTPRequestHandler):
    server: HostileHead
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        replies = {
            "/api/jobs/honest-1": {"status": "RUNNING", "message": "ok", "driver_node_id": "n1"},
            # within the reply's cap, and still more than a status holds
            "/api/jobs/chatty-1": {
                "status": "RUNNING",
                "message": "m" * 900_000,
                "driver_node_id": "n" * 9000,
            },
            "/api/jobs/odd-1": ["not", "an", "object"],
        }
        if self.path in replies:
            body = json.dumps(replies[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path.startswith("/api/jobs/trickle-"):  # a byte every 0.2 s, each well within a read timeout
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n"
            answer = (head if "headers" in self.path else head + b"\r\n") + b"x" * 100_000
            try:
                for byte in answer:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    self.server.sent += 1
                    time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        endless = self.path.startswith("/api/jobs/") or self.path.startswith("/api/v0/logs/file")
        assert endless, self.path
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        start = b'{"status": "RUNNING", "message": "' if self.path.startswith("/api/jobs/") else b""
        chunk = start + b"x" * (MIB - len(start))
        try:
            while self.server.sent < self.server.limit:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.server.sent += len(chunk)
                chunk = chunk if not start else b"x" * MIB
                start = b""
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client closed the connection: what a bounded reader does


@pytest.fixture
def head() -> Iterator[HostileHead]:
    server = HostileHead()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_an_endless_job_status_reply_is_refused_after_its_cap_and_the_next_request_works(
    head: HostileHead,
) -> None:
    jobs = Jobs(head.url)
    with pytest.raises(ResponseTooLarge) as refused:
        jobs.observe("hostile-1")
    assert f"{head.url}/api/jobs/hostile-1" in str(refused.value) and str(MAX_RESPONSE_BYTES) in str(
        refused.value
    )
    # The connection was closed, not drained: the head sent its cap and what the sockets' buffers hold, not
    # the 256 MiB it had (the operator read at most the cap and one byte of it).
    assert head.sent < 64 * MIB, head.sent
    honest = jobs.observe("honest-1", with_logs=False)
    assert (honest.status, honest.message) == ("RUNNING", "ok")


def test_an_endless_driver_log_is_cut_at_its_limit_not_drained(head: HostileHead) -> None:
    response = Jobs(head.url).client.log_tail("hostile-1", "n1", lines=60, limit=16_000)
    assert response.status == 200 and len(response.text) == 16_000
    assert head.sent < 64 * MIB, head.sent
    assert jobclient.MAX_RESPONSE_BYTES == MIB


def test_a_job_status_within_the_cap_is_kept_to_what_a_status_holds(head: HostileHead) -> None:
    jobs = Jobs(head.url)
    chatty = jobs.observe("chatty-1", with_logs=False)
    assert chatty.status == "RUNNING" and len(chatty.message) == MAX_JOB_MESSAGE
    assert chatty.driver_node_id is not None and len(chatty.driver_node_id) == MAX_JOB_FIELD
    with pytest.raises(ValueError, match="not a JSON object"):
        jobs.observe("odd-1")


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_head_answering_a_byte_at_a_time_holds_a_call_no_longer_than_its_deadline(
    head: HostileHead, part: str
) -> None:
    """Issue 46: the read timeout was per socket read, so tenant code on the head answering one byte every
    few seconds held a handler thread (and the run's lock) for ever."""
    client = jobclient.JobClient(head.url, timeout=(5.0, 2.0), deadline=3.0)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"longer than 3\.0s in all|timed out"):
        client.job_info(f"trickle-{part}-1")
    took = time.monotonic() - started
    assert took < 4.5, f"the call took {took:.1f}s against a deadline of 3 s"
    assert head.sent < 40, head.sent  # a byte every 0.2 s: 15 in the 3 s


def deep_run(name: str, depth: int) -> str:
    """The demo run with a fromConfig `depth` maps deep, as JSON text (json.dumps itself stops at 1,000)."""
    run = example("cpu-demo")
    run["metadata"]["name"] = name
    run["spec"]["model"]["fromConfig"] = "__DEEP__"
    deep = '{"model_type": "qwen2", "sub": ' * (depth - 1) + '{"model_type": "qwen2"}' + "}" * (depth - 1)
    return json.dumps(run).replace('"__DEEP__"', deep)


def phase_of(namespace: str, name: str) -> str | None:
    """Read with kubectl's jsonpath: this process's json.loads could not parse the deep run either."""
    got = kubectl(
        "get", "fsdptrainingrun", name, "-n", namespace, "-o", "jsonpath={.status.phase}", check=False
    )
    return got.stdout.strip() or None


def test_a_1500_deep_from_config_fails_its_own_run_and_every_other_run_goes_on(
    namespace: str, operator: OperatorProcess
) -> None:
    """The apiserver takes a 1,500-deep map (it parses 10,000 levels); Python's JSON parser stops at 1,000 by
    default. The operator lists and watches it with every other run of the namespace, fails it (status and
    an Event) naming spec.model.fromConfig, and keeps taking up the others, after a restart (a LIST holding
    it) too. Fails without the operator's raised recursion limit: kopf's LIST of runs stops every run."""
    created = kubectl("create", "-n", namespace, "-f", "-", input=deep_run("deep", 1500), check=False)
    assert created.returncode == 0, created.stderr[-600:]
    honest = example("cpu-demo")
    honest["metadata"]["name"] = "honest"
    kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(honest))
    wait_until("the honest run to get a phase", lambda: phase_of(namespace, "honest"), timeout=120)

    def refused() -> str | None:
        said = kubectl(
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            "involvedObject.name=deep,reason=InvalidSpec",
            "-o",
            "jsonpath={.items[*].message}",
            check=False,
        ).stdout
        return said if "spec.model.fromConfig" in said else None

    said = wait_until("an InvalidSpec event of the deep run naming the field", refused, timeout=120)
    assert "nested deeper than 8 levels" in said
    assert phase_of(namespace, "deep") == "Failed"  # in its own status too
    built = [c for c in rayclusters(namespace) if c["metadata"].get("labels", {}).get(LABEL_RUN) == "deep"]
    assert built == [], "a RayCluster was built for the deep run"

    operator.stop()  # a new operator LISTs the namespace, the deep run with it
    operator.start()
    after = example("cpu-demo")
    after["metadata"]["name"] = "after-restart"
    kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(after))
    wait_until(
        "a run created after the restart to get a phase",
        lambda: phase_of(namespace, "after-restart"),
        timeout=120,
    )
    assert operator.process is not None and operator.process.poll() is None, "the operator exited"
    assert "RecursionError" not in operator.log.read_text()


def peak_rss_mib(proc: OperatorProcess) -> float:
    assert proc.process is not None
    return memory_kib(proc.process.pid, "VmHWM") / 1024


def test_a_hundred_near_cap_manifests_cost_the_operator_a_bounded_peak_rss(
    namespace: str, crd_installed: None, s3_storage: str, tmp_path: Path
) -> None:
    """Issue 46: every manifest read was kept, parsed, for the run's life: a hundred just-under-1-MiB
    manifests of checkpoints that never complete took the operator past its memory limit. Now a pass reads
    them within its budget, the run's storage is refused (RecordTooLarge) and nothing is kept."""
    bucket = s3_storage.removeprefix("s3://").split("/")[0]
    proc = OperatorProcess(
        namespace, {"FSDP_OPERATOR_S3_PREFIXES": f"s3://{bucket}/"}, tmp_path / "operator.log"
    ).start()
    try:
        apply(namespace, example("aws-sample", **{"checkpoint.storagePath": s3_storage}))
        wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
        before = peak_rss_mib(proc)
        s3 = boto3.client("s3")
        prefix = f"runs/{namespace}/qwen25-sample/"
        files = {f"shard-{i:07d}.distcp": i for i in range(33_000)}  # just under 1 MiB of JSON
        manifest = {"runName": "qwen25-sample", "step": 1, "tokensSeen": 0, "worldSize": 1,
                    "createdAt": "2026-12-06T08:00:00Z", "files": files}  # fmt: skip
        body = json.dumps(manifest).encode()
        assert len(body) < MAX_RECORD_BYTES[MANIFEST_FILE]
        for i in range(100):  # no DCP metadata beside them: never complete
            s3.put_object(Bucket=bucket, Key=f"{prefix}checkpoint_{i:06d}/{MANIFEST_FILE}", Body=body)

        def storage_refused() -> dict[str, Any] | None:
            said = conditions_of(run_of(namespace, "qwen25-sample")).get("StorageReadable")
            return said if said and said["reason"] == "RecordTooLarge" else None

        refused = wait_until("StorageReadable=False RecordTooLarge on the run", storage_refused, timeout=60)
        assert "add up to more than the operator reads in a pass" in refused["message"]
        # Another run beside it, while every pass of the hostile one meets the manifests again.
        honest = example("aws-sample", **{"checkpoint.storagePath": s3_storage})
        honest["metadata"]["name"] = "honest"
        applied = time.monotonic()
        apply(namespace, honest)
        ready = wait_for_phase(namespace, "honest", "ClusterReady")
        took = time.monotonic() - applied
        assert conditions_of(ready).get("StorageReadable", {}).get("status") != "False", ready["status"]
        after = peak_rss_mib(proc)
        print(f"operator peak RSS {before:.0f} MiB before the manifests, {after:.0f} MiB after; the run "
              f"beside it ClusterReady {took:.1f}s after apply")  # fmt: skip
        assert after - before < 64, f"peak RSS grew {after - before:.0f} MiB ({before:.0f} -> {after:.0f})"
    finally:
        proc.stop()
