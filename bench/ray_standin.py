"""A stand-in for a Ray head's job API, for `bench/load.py` only: one local Ray head cannot host 200 drivers
on two cores. It answers what the operator sends a Ray dashboard (the version check, the trainer package
upload, submit, status, stop, the log tail) and, for every submitted job, writes to S3 what the trainer writes
there: a progress record every `training.logEvery` steps, a complete checkpoint (two shard files, DCP
metadata, the manifest last) every `checkpoint.everySteps` steps, and the final record at
`training.maxSteps`, when the job succeeds. One step takes `--step-seconds`. Nothing else about the job (no
model, no data) is real.

    python bench/ray_standin.py --port 0 --port-file PATH   (bench/load.py starts it)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from aiohttp import web

from fsdp_trainer.contract import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    PROGRESS_FILE,
    CheckpointManifest,
    ProgressRecord,
    TrainerConfig,
)

RAY_VERSION = "2.58.0"
SHARD_BYTES = 1024
ACTIVE = ("PENDING", "RUNNING")
STEP_SECONDS_ENV = "LOAD_BENCH_STEP_SECONDS"
FAULT_ENV = "LOAD_BENCH_FAULT"


@dataclass
class Job:
    submission_id: str
    entrypoint: str
    metadata: dict[str, str]
    runtime_env: dict[str, Any]
    config: TrainerConfig | None  # None: not the trainer (a RayJob's job)
    status: str = "RUNNING"
    message: str = ""
    start_time: int = field(default_factory=lambda: int(time.time() * 1000))
    end_time: int | None = None
    task: asyncio.Task[None] | None = None

    def details(self) -> dict[str, Any]:
        return {
            "type": "SUBMISSION",
            "job_id": None,
            "submission_id": self.submission_id,
            "driver_info": None,
            "status": self.status,
            "entrypoint": self.entrypoint,
            "message": self.message,
            "error_type": None,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "metadata": self.metadata,
            "runtime_env": self.runtime_env,
            "driver_agent_http_address": None,
            "driver_node_id": None,
            "driver_exit_code": 0 if self.status == "SUCCEEDED" else None,
        }


def config_of(entrypoint: str) -> TrainerConfig | None:
    """The trainer config the operator put on the entrypoint (`python -m fsdp_trainer --config JSON ...`);
    None for any other entrypoint."""
    words = shlex.split(entrypoint)
    if "--config" not in words:
        return None
    return TrainerConfig.model_validate_json(words[words.index("--config") + 1])


def fault_of(env: dict[str, str]) -> tuple[str, float] | None:
    """LOAD_BENCH_FAULT's `fail:SECONDS` or `hang:SECONDS`."""
    if FAULT_ENV not in env:
        return None
    kind, _, seconds = env[FAULT_ENV].partition(":")
    if kind not in ("fail", "hang"):
        raise ValueError(f"{FAULT_ENV} must be fail:SECONDS or hang:SECONDS, not {env[FAULT_ENV]!r}")
    return kind, float(seconds)


class StandIn:
    def __init__(self, step_seconds: float, events: Path | None) -> None:
        self.step_seconds = step_seconds
        self.jobs: dict[str, Job] = {}
        self.packages: set[str] = set()
        self.faulted: set[str] = set()  # runs whose fault has happened: their later attempts train on
        self.requests: Counter[str] = Counter()
        self.events = events.open("a", buffering=1) if events else None
        self.s3 = boto3.client("s3")  # AWS_ENDPOINT_URL and credentials from the environment

    def event(self, job: Job, kind: str, at: dt.datetime, **figures: Any) -> None:
        assert job.config is not None
        if self.events is not None:
            record = {"run": job.config.run_uri(), "event": kind, "at": at.isoformat(), **figures}
            self.events.write(json.dumps(record) + "\n")

    def put(self, uri: str, body: bytes) -> None:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        self.s3.put_object(Bucket=bucket, Key=key, Body=body)

    async def train(self, job: Job) -> None:
        config, now = job.config, lambda: dt.datetime.now(dt.UTC)
        if config is None:  # not the trainer: runs until stopped
            await asyncio.Event().wait()
            return
        run, maximum = config.run_uri(), config.training.max_steps
        every_log, every_checkpoint = max(config.training.log_every, 1), config.checkpoint.every_steps
        env = job.runtime_env.get("env_vars") or {}
        step_seconds = float(env.get(STEP_SECONDS_ENV, self.step_seconds))
        fault = None if run in self.faulted else fault_of(env)
        fault_at = time.monotonic() + fault[1] if fault else None
        last_record = now()

        def record(phase: str, step: int) -> bytes:
            return ProgressRecord(
                run_name=config.run_name, phase=phase, submission_id=job.submission_id, step=step,
                max_steps=maximum, loss=5.0 / (1 + step / 100), tokens_per_second=1000.0,
                tokens_seen=step * 256, world_size=config.workers, updated_at=now(),
            ).to_json().encode()  # fmt: skip

        await asyncio.to_thread(self.put, f"{run}/{PROGRESS_FILE}", record("starting", 0))
        for step in range(1, maximum + 1):
            await asyncio.sleep(step_seconds)
            if fault is not None and fault_at is not None and time.monotonic() >= fault_at:
                self.faulted.add(run)
                if fault[0] == "fail":
                    job.status, job.end_time = "FAILED", int(time.time() * 1000)
                    job.message = f"{FAULT_ENV} failed the job at step {step}"
                    self.event(job, "failed", now(), step=step)
                    return
                self.event(job, "hung", last_record, step=step)  # the hang counts from the last record
                await asyncio.Event().wait()  # RUNNING, and silent, until stopped
            if step % every_log == 0 or step == maximum:
                phase = "finished" if step == maximum else "training"
                await asyncio.to_thread(self.put, f"{run}/{PROGRESS_FILE}", record(phase, step))
                last_record = now()
            if every_checkpoint and step % every_checkpoint == 0:
                await asyncio.to_thread(self.checkpoint, job, step)
                self.event(job, "checkpoint", now(), step=step)
        job.status, job.end_time = "SUCCEEDED", int(time.time() * 1000)

    def checkpoint(self, job: Job, step: int) -> None:
        assert job.config is not None
        directory = f"{job.config.run_uri()}/checkpoint_{step:08d}_{job.submission_id}"
        files = {"__0_0.distcp": SHARD_BYTES, "__1_0.distcp": SHARD_BYTES, DCP_METADATA_FILE: SHARD_BYTES}
        for name, size in files.items():
            self.put(f"{directory}/{name}", b"\0" * size)
        manifest = CheckpointManifest(
            run_name=job.config.run_name, step=step, tokens_seen=step * 256, world_size=job.config.workers,
            created_at=dt.datetime.now(dt.UTC), files=files, submission_id=job.submission_id,
            fingerprint=job.config.resume_fingerprint(),
        )  # fmt: skip
        self.put(f"{directory}/{MANIFEST_FILE}", manifest.to_json().encode())

    # -- the job API, as Ray's JobSubmissionClient calls it -----------------------------------------------

    @web.middleware
    async def count(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/api/"):
            sender = "kuberay" if request.host.endswith(".svc.cluster.local") else "operator"
            resource = request.match_info.route.resource
            self.requests[f"{sender} {request.method} {resource.canonical if resource else '?'}"] += 1
        return await handler(request)

    async def counts(self, _: web.Request) -> web.Response:
        return web.json_response(dict(self.requests))

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "4", "ray_version": RAY_VERSION, "ray_commit": "standin"})

    async def package(self, request: web.Request) -> web.Response:
        name = f"{request.match_info['protocol']}/{request.match_info['name']}"
        if request.method == "PUT":
            await request.read()
            self.packages.add(name)
            return web.Response(text="ok")
        return web.Response(status=200 if name in self.packages else 404)

    async def submit(self, request: web.Request) -> web.Response:
        body = await request.json()
        submission_id = body["submission_id"]
        if submission_id in self.jobs:
            return web.Response(status=400, text=f"Job with submission_id {submission_id} already exists.")
        job = Job(
            submission_id, body["entrypoint"], body.get("metadata") or {}, body.get("runtime_env") or {},
            config_of(body["entrypoint"]),
        )  # fmt: skip
        job.task = asyncio.create_task(self.train(job))
        self.jobs[submission_id] = job
        return web.json_response({"job_id": submission_id, "submission_id": submission_id})

    def job_of(self, request: web.Request) -> Job:
        submission_id = request.match_info["id"]
        if submission_id not in self.jobs:
            raise web.HTTPNotFound(text=f"Job {submission_id} does not exist")
        return self.jobs[submission_id]

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self.job_of(request).details())

    async def list_jobs(self, _: web.Request) -> web.Response:
        return web.json_response([job.details() for job in self.jobs.values()])

    async def stop(self, request: web.Request) -> web.Response:
        job = self.job_of(request)
        stopped = job.status in ACTIVE
        if stopped and job.task is not None:
            job.task.cancel()
            job.status, job.end_time = "STOPPED", int(time.time() * 1000)
        return web.json_response({"stopped": stopped})

    async def logs(self, _: web.Request) -> web.Response:
        return web.Response(status=500, text="Could not find a log file (a stand-in job has none)")

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.count])
        app.add_routes(
            [
                web.get("/api/version", self.version),
                web.get("/api/packages/{protocol}/{name}", self.package),
                web.put("/api/packages/{protocol}/{name}", self.package),
                web.post("/api/jobs/", self.submit),
                web.get("/api/jobs/", self.list_jobs),
                web.get("/api/jobs/{id}", self.get),
                web.post("/api/jobs/{id}/stop", self.stop),
                web.get("/api/v0/logs/file", self.logs),
                web.get("/bench/requests", self.counts),
            ]
        )
        return app


async def serve(port: int, port_file: Path | None, step_seconds: float, events: Path | None) -> None:
    runner = web.AppRunner(StandIn(step_seconds, events).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if port_file is not None:
        port_file.write_text(str(bound))
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--events", type=Path, help="append checkpoints, failures and hangs (JSON lines)")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.port_file, args.step_seconds, args.events))


if __name__ == "__main__":
    main()
