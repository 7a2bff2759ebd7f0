"""The operator's apiserver traffic at steady state, counted from the apiserver's own audit log.

Budget (issue: "a cache instead of polling"): at most 2 requests per running run per minute besides status
writes, and none for a finished run. The runs are held in Running by a trainer fault that stops every rank
at step 1 (their processes stay alive, so Ray reports RUNNING and nothing new is written).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections import Counter
from pathlib import Path

from tests.apiserver_audit import KOPF_USER_AGENT, OPERATOR_USER_AGENT, AuditLog
from tests.e2e.demo import RUN_TIMEOUT, demo_manifest, lifecycle_env
from tests.e2e.demo import SMALL as SMALL_SHAPE
from tests.harness import LocalCluster, OperatorProcess, apply, kubectl, run_of, wait_for_phase, wait_until

RUNS = 3
WINDOW_SECONDS = 30  # 0 requests expected; the budget allows 3 in this window
PER_RUN_PER_MINUTE = 2
KOPF_TIMER_RECHECK_SECONDS = 60
SMALL = {**SMALL_SHAPE, "training.maxSteps": 400}  # every run fits the fake nodes at once


def test_running_runs_cost_at_most_two_requests_a_minute_each_and_finished_runs_none(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, tmp_path: Path
) -> None:
    proc = OperatorProcess(
        namespace=namespace, env=lifecycle_env(local_cluster), log=tmp_path / "operator.log"
    ).start()
    try:
        finished = f"finished-{uuid.uuid4().hex[:4]}"
        missing = {"data.source": "s3://fsdp-e2e/data/no-such-file.jsonl", **SMALL}
        apply(namespace, demo_manifest(finished, **missing))
        names = [f"held-{i}-{uuid.uuid4().hex[:4]}" for i in range(RUNS)]
        for name in names:
            hold = {"FSDP_TRAINER_FAULT": f"rank=0,step=1,marker={tmp_path / name},action=hang"}
            apply(namespace, demo_manifest(name, **{"runtimeEnv": {"env": hold}, **SMALL}))
        wait_for_phase(namespace, finished, "Failed", timeout=RUN_TIMEOUT)
        finished_at = time.monotonic()
        for name in names:
            wait_for_phase(namespace, name, "Running", timeout=RUN_TIMEOUT)

        def settled() -> bool:  # held at step 1 (or set up and silent): no more status changes
            before = [run_of(namespace, n)["metadata"]["resourceVersion"] for n in names]
            time.sleep(10)
            return before == [run_of(namespace, n)["metadata"]["resourceVersion"] for n in names]

        wait_until("the held runs to stop changing", settled, timeout=RUN_TIMEOUT, interval=0)
        # kopf touches a run once, 60 s after its timer stopped (the run finished), to see that it did.
        time.sleep(max(KOPF_TIMER_RECHECK_SECONDS + 10 - (time.monotonic() - finished_at), 0))
        log = AuditLog.of_local_cluster()
        since = dt.datetime.now(dt.UTC)
        time.sleep(WINDOW_SECONDS)
        until = dt.datetime.now(dt.UTC)
        requests = [
            r for agent in (KOPF_USER_AGENT, OPERATOR_USER_AGENT) for r in log.requests(agent, since, until)
        ]
        counts = Counter(r.kind for r in requests)
        assert not [r for r in requests if r.name.startswith(finished)], "a finished run was visited"
        per_run = {key: n for key, n in counts.items() if key[1] != "leases" and key[2] != "status"}
        print(f"operator requests in {WINDOW_SECONDS}s with {RUNS} held runs: {dict(counts)}")
        assert sum(per_run.values()) <= PER_RUN_PER_MINUTE * RUNS * WINDOW_SECONDS / 60, per_run
        assert all(run_of(namespace, n)["status"]["phase"] == "Running" for n in names)
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ---\n{proc.log.read_text()[-4000:]}")
