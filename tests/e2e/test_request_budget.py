"""The operator's apiserver traffic at steady state, counted from the apiserver's own audit log.

Budget (issue: "a cache instead of polling"): at most 2 requests per running run per minute besides status
writes (and the watches, renewed per resource type), and none for a finished run. The runs are held in
Running by a trainer fault that stops every rank at step 1 (their processes stay alive, so Ray reports
RUNNING and nothing new is written).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from tests.support.apiserver_audit import KOPF_USER_AGENT, OPERATOR_USER_AGENT, AuditEvent, AuditLog
from tests.support.demo import RUN_TIMEOUT, demo_manifest
from tests.support.demo import SMALL as SMALL_SHAPE
from tests.support.kube import apply
from tests.support.operator_process import OperatorProcess
from tests.support.runs import run_of, wait_for_phase
from tests.support.waiting import wait_until

RUNS = 2
WINDOW_SECONDS = 30  # 0 requests expected; the budget allows 2 in this window
PER_RUN_PER_MINUTE = 2
FINISHED_SETTLE = dt.timedelta(seconds=5)
FINISHED_QUIET_SECONDS = 70  # longer than kopf's 60 s re-check of a stopped timer, which must not happen
SMALL = {**SMALL_SHAPE, "training.maxSteps": 400}  # every run fits the fake nodes at once


def test_running_runs_cost_at_most_two_requests_a_minute_each_and_finished_runs_none(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any, tmp_path: Path
) -> None:
    finished = f"finished-{uuid.uuid4().hex[:4]}"
    missing = {"data.source": "s3://fsdp-e2e/data/no-such-file.jsonl", **SMALL}
    apply(namespace, demo_manifest(finished, **missing))
    # Finished before the others start: four Ray jobs starting at once on two cores take twice as long.
    wait_for_phase(namespace, finished, "Failed", timeout=RUN_TIMEOUT)
    finished_at = dt.datetime.now(dt.UTC)
    names = [f"held-{i}-{uuid.uuid4().hex[:4]}" for i in range(RUNS)]
    for name in names:
        hold = {"FSDP_TRAINER_FAULT": f"rank=0,step=1,marker={tmp_path / name},action=hang"}
        apply(namespace, demo_manifest(name, **{"runtimeEnv": {"env": hold}, **SMALL}))
    for name in names:
        wait_for_phase(namespace, name, "Running", timeout=RUN_TIMEOUT)

    def settled() -> bool:  # held at step 1 (or set up and silent): no more status changes
        before = [run_of(namespace, n)["metadata"]["resourceVersion"] for n in names]
        time.sleep(10)
        return before == [run_of(namespace, n)["metadata"]["resourceVersion"] for n in names]

    wait_until("the held runs to stop changing", settled, timeout=RUN_TIMEOUT, interval=0)
    log = AuditLog.of_local_cluster()
    since = dt.datetime.now(dt.UTC)
    time.sleep(max(WINDOW_SECONDS, FINISHED_QUIET_SECONDS - (since - finished_at).total_seconds()))
    until = dt.datetime.now(dt.UTC)

    def requests_by_the_operator(start: dt.datetime) -> list[AuditEvent]:
        agents = (KOPF_USER_AGENT, OPERATOR_USER_AGENT)
        return [r for agent in agents for r in log.requests(agent, start, until)]

    # Settling the finished run (its last status write, its Event) takes a few seconds; after that,
    # nothing: kopf's default would touch it once more a minute after its timer stopped.
    late = [r for r in requests_by_the_operator(finished_at + FINISHED_SETTLE) if r.name.startswith(finished)]
    assert not late, f"a finished run was visited: {late}"
    requests = requests_by_the_operator(since)
    counts = Counter(r.kind for r in requests)
    # Watches are renewed once a minute per resource type, however many runs there are.
    per_run = {
        key: n for key, n in counts.items() if key[0] != "watch" and key[1] != "leases" and key[2] != "status"
    }
    print(f"operator requests in {WINDOW_SECONDS}s with {RUNS} held runs: {dict(counts)}")
    assert sum(per_run.values()) <= PER_RUN_PER_MINUTE * RUNS * WINDOW_SECONDS / 60, per_run
    assert all(run_of(namespace, n)["status"]["phase"] == "Running" for n in names)
