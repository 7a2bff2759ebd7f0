"""The trainer end to end: `python -m fsdp_trainer` on a Ray head of this module's own, 2 CPU workers (gloo),
a tiny Qwen2 with the byte-level tokenizer, the stdlib-docstring corpus, checkpoints in the local S3 server.

Everything is read back with boto3 alone, as the operator does. Runs are shared where one run honestly
shows several things: the uninterrupted reference run gives the loss trajectory that the resumed runs must
follow, and the resubmitted run's storage is then corrupted for the last run.

Loss-trajectory tolerance: a resumed step must match the uninterrupted run's loss at the same step within
1e-4 absolute. Restoring model, optimizer, scheduler, data position and RNG makes the resumed steps the same
computation (same world size, gloo on CPU), so any real restore bug shows as a difference of order 1e-2 or
more; the tolerance only absorbs floating-point reduction order.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from fsdp_trainer.contract import (
    MANIFEST_FILE,
    METRICS_DIR,
    MODEL_DIR,
    PROGRESS_FILE,
    CheckpointManifest,
    ProgressRecord,
    TrainerConfig,
)
from tests.support.manifests import CHATML, tiny_qwen2
from tests.support.net import free_port
from tests.support.paths import REPO
from tests.support.processes import stop_process_group
from tests.support.ray_nodes import worker_port_flags
from tests.support.waiting import wait_until

CORPUS = REPO / "examples" / "data" / "stdlib-docstrings.jsonl"
CHAT_CORPUS = REPO / "examples" / "data" / "stdlib-chat.jsonl"
TOLERANCE = 1e-4
MAX_STEPS = 24
CHECKPOINT_EVERY = 8
RUN_TIMEOUT_S = 300
# Ray's single-machine switch (named for the platforms where it is the default): the head, its servers and the
# drivers that join it all use 127.0.0.1 instead of the host's address. Head and driver must agree.
SINGLE_MACHINE_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
TINY_QWEN2 = tiny_qwen2(hidden_size=64, intermediate_size=128, max_position_embeddings=128)


def trainer_config(run_name: str, storage: str, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "runName": run_name,
        "workers": 2,
        "cpusPerWorker": 1,
        "model": {"fromConfig": TINY_QWEN2, "tokenizer": "byte-level"},
        "training": {
            "maxSteps": MAX_STEPS,
            "microBatchSize": 4,
            "sequenceLength": 64,
            "learningRate": 3e-3,
            "warmupSteps": 2,
            "seed": 7,
            "logEvery": 1,
        },
        "data": {"source": str(CORPUS), "evalEvery": 12, "evalBatches": 4},
        "checkpoint": {"storagePath": storage, "everySteps": CHECKPOINT_EVERY, "keep": 3},
        "network": {"bandwidthProbeMb": 1},
    }
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    return config


# ----------------------------------------------------------------------------------------------------------
# Fixtures: a Ray head and a bucket


@pytest.fixture(scope="module")
def ray_address(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`ray start --head --block` in its own process group, stopped by pid at the end.

    Its raylet's environment is what the workers get: the S3 endpoint, the trainer package, no hub access.
    RAY_ADDRESS points Ray's own internal lookups at this head even when other Ray instances run here.
    """
    port, client_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("ray") / "head.log"
    # Ray's session files in a short directory of ours (its socket paths live below it), and the jobs'
    # temporary files (a killed trainer's checkpoint staging) and node cache under pytest's temporary dir.
    session = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path_factory.mktemp("tmp")),
        "FSDP_TRAINER_CACHE": str(tmp_path_factory.mktemp("trainer-cache")),
        "RAY_ADDRESS": address,
        "PYTHONPATH": str(REPO / "trainer"),
        "HF_HUB_OFFLINE": "1",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        "RAY_DEDUP_LOGS": "0",
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # as on the local cluster's head (hack/ray-head.sh)
        **SINGLE_MACHINE_RAY,
    }
    ray = Path(sys.executable).with_name("ray")
    with log.open("wb") as out:
        head = subprocess.Popen(
            [ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
             f"--ray-client-server-port={client_port}", "--num-cpus=2", "--include-dashboard=false",
             f"--temp-dir={session}", "--disable-usage-stats", *worker_port_flags(0), "--block"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(
            f"the Ray head at {address} to start (log {log})",
            lambda: head.poll() is None and "Ray runtime started" in log.read_text(),
            timeout=120,
        )
        yield address
    finally:
        stop_process_group(head)
        shutil.rmtree(session, ignore_errors=True)


NAMESPACE = "default"  # TrainerConfig.namespace when the config names none
RUNS = f"runs/{NAMESPACE}"  # the key prefix of every run: <storagePath>/<namespace>/<runName>


@dataclass(frozen=True)
class Storage:
    bucket: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/runs"

    def client(self) -> Any:
        return boto3.client("s3")

    def keys(self, prefix: str) -> dict[str, int]:
        """Object keys and sizes under <RUNS>/<prefix>, without the empty "dir/" markers pyarrow leaves."""
        paginator = self.client().get_paginator("list_objects_v2")
        return {
            obj["Key"]: obj["Size"]
            for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{RUNS}/{prefix}")
            for obj in page.get("Contents", [])
            if not obj["Key"].endswith("/")
        }

    def read(self, key: str) -> str:
        return str(self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read().decode())

    def delete(self, key: str) -> None:
        self.client().delete_object(Bucket=self.bucket, Key=key)

    def progress(self, run: str) -> ProgressRecord:
        return ProgressRecord.model_validate_json(self.read(f"{RUNS}/{run}/{PROGRESS_FILE}"))

    def history(self, run: str) -> list[list[ProgressRecord]]:
        """The progress records of each attempt, attempts in time order."""
        files = sorted(key for key in self.keys(f"{run}/{METRICS_DIR}/") if key.endswith(".jsonl"))
        return [
            [ProgressRecord.model_validate_json(line) for line in self.read(key).splitlines() if line]
            for key in files
        ]

    def checkpoints(self, run: str) -> dict[str, CheckpointManifest | None]:
        """Checkpoint directory -> its manifest (None when it has none)."""
        keys = self.keys(f"{run}/checkpoint_")
        depth = RUNS.count("/") + 3  # RUNS/<run>/<checkpoint>/<file>
        directories = sorted({key.split("/")[depth - 1] for key in keys if key.count("/") == depth})
        return {
            directory: (
                CheckpointManifest.model_validate_json(self.read(manifest_key))
                if (manifest_key := f"{RUNS}/{run}/{directory}/{MANIFEST_FILE}") in keys
                else None
            )
            for directory in directories
        }


@pytest.fixture(scope="module")
def storage(s3_endpoint: str) -> Storage:
    bucket = f"trainer-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
    )
    return Storage(bucket)


@dataclass(frozen=True)
class Submission:
    returncode: int
    output: str
    seconds: float


def submit(
    ray_address: str, config: dict[str, Any], fault: str | None = None, *extra_args: str
) -> Submission:
    """Runs the trainer exactly as the operator's Ray job does: `python -m fsdp_trainer --config <json>`."""
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_address,
        "PYTHONPATH": str(REPO / "trainer"),
        "HF_HUB_OFFLINE": "1",
        **SINGLE_MACHINE_RAY,
    }
    env.pop("FSDP_TRAINER_FAULT", None)
    if fault:
        env["FSDP_TRAINER_FAULT"] = fault
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fsdp_trainer", "--config", json.dumps(config), *extra_args],
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(
            f"trainer run {config['runName']} did not finish within {RUN_TIMEOUT_S}s:\n"
            f"{expired.stdout!s}\n{expired.stderr!s}"
        ) from expired
    seconds = time.monotonic() - start
    print(f"trainer run {config['runName']}: exit {done.returncode} after {seconds:.1f}s")
    return Submission(done.returncode, done.stdout + done.stderr, seconds)


def losses(records: list[ProgressRecord]) -> dict[int, float]:
    return {r.step: r.loss for r in records if r.phase == "training" and r.loss is not None and r.step > 0}


def assert_same_trajectory(resumed: dict[int, float], reference: dict[int, float], steps: range) -> None:
    differences = {step: abs(resumed[step] - reference[step]) for step in steps}
    worst = max(differences, key=differences.__getitem__)
    print(f"largest loss difference from the uninterrupted run: {differences[worst]:.2e} at step {worst}")
    assert differences[worst] <= TOLERANCE, (
        f"resumed loss differs from the uninterrupted run at step {worst}: "
        f"{resumed[worst]:.6f} vs {reference[worst]:.6f} (tolerance {TOLERANCE})"
    )


# ----------------------------------------------------------------------------------------------------------
# The uninterrupted reference run


@dataclass(frozen=True)
class ReferenceRun:
    name: str
    submission: Submission
    progress: ProgressRecord
    losses: dict[int, float]


@pytest.fixture(scope="module")
def reference(ray_address: str, storage: Storage) -> ReferenceRun:
    name = "reference"
    submission = submit(ray_address, trainer_config(name, storage.uri))
    assert submission.returncode == 0, submission.output[-6000:]
    history = storage.history(name)
    assert len(history) == 1, f"one attempt expected, found {len(history)}"
    return ReferenceRun(name, submission, storage.progress(name), losses(history[0]))


def test_loss_falls_on_real_text_and_eval_is_reported(reference: ReferenceRun, storage: Storage) -> None:
    progress = reference.progress
    assert progress.phase == "finished" and progress.step == MAX_STEPS
    assert sorted(reference.losses) == list(range(1, MAX_STEPS + 1))
    first, last = reference.losses[1], reference.losses[MAX_STEPS]
    print(
        f"loss {first:.3f} -> {last:.3f}, "
        f"eval loss {progress.eval_loss:.3f}, perplexity {progress.eval_perplexity:.1f}"
    )
    assert first > math.log(256) - 0.5, f"an untrained byte model starts near ln(256); got {first}"
    assert last < first - 1.0, f"loss should fall by more than 1 nat in {MAX_STEPS} steps: {first} -> {last}"
    assert progress.eval_loss is not None and progress.eval_perplexity is not None
    assert progress.eval_perplexity == pytest.approx(math.exp(progress.eval_loss), rel=1e-6)
    assert progress.eval_perplexity < 256, "held-out perplexity should beat a uniform byte guess"

    assert progress.world_size == 2 and progress.resumed_from_step is None
    assert progress.tokens_seen == MAX_STEPS * 2 * 4 * 64
    assert progress.tokens_per_second and progress.tokens_per_second_per_device
    assert progress.tokens_per_second == pytest.approx(progress.tokens_per_second_per_device * 2)
    assert progress.learning_rate is not None and progress.grad_norm is not None
    assert progress.peak_memory_bytes and progress.step_time_seconds
    assert progress.mfu is None, "no peak-FLOPs figure exists for a CPU"
    assert progress.transport is not None and progress.transport.observed == "gloo"
    assert progress.transport.bus_bandwidth_gbps is not None and progress.transport.bus_bandwidth_gbps > 0
    assert progress.versions.torch and progress.versions.ray

    checkpoints = storage.checkpoints(reference.name)
    manifests = [m for m in checkpoints.values() if m is not None]
    assert sorted(m.step for m in manifests) == [8, 16, 24], checkpoints
    for directory, manifest in checkpoints.items():
        assert manifest is not None
        stored = storage.keys(f"{reference.name}/{directory}/")
        for name, size in manifest.files.items():
            assert stored[f"{RUNS}/{reference.name}/{directory}/{name}"] == size
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(manifest.files)
        assert manifest.world_size == 2 and manifest.tokens_seen == manifest.step * 2 * 4 * 64
    config = TrainerConfig.model_validate(trainer_config(reference.name, storage.uri))
    fingerprint = config.resume_fingerprint()
    assert {m.fingerprint for m in manifests} == {fingerprint}, "resume requires the same configuration"
    (records,) = storage.history(reference.name)
    assert len({r.submission_id for r in records}) == 1 and records[0].submission_id
    stages = [r.stage for r in records if r.phase == "starting"]
    assert {"initializing", "downloading-model", "loading-data", "probing-transport"} <= set(stages)
    print("checkpoint sizes (bytes):", {m.step: sum(m.files.values()) for m in manifests})
    assert reference.losses[MAX_STEPS] == pytest.approx(manifests[-1].loss)


def test_exported_model_is_a_loadable_hugging_face_model(
    reference: ReferenceRun, storage: Storage, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert reference.progress.exported_model_uri == f"{storage.uri}/{NAMESPACE}/{reference.name}/{MODEL_DIR}"
    keys = storage.keys(f"{reference.name}/{MODEL_DIR}/")
    assert any(key.endswith(".safetensors") for key in keys), keys
    for key in keys:
        target = tmp_path / key.rsplit("/", 1)[-1]
        storage.client().download_file(storage.bucket, key, str(target))
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.hidden_size == TINY_QWEN2["hidden_size"]
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    text = CORPUS.read_text().splitlines()[0]
    batch = tokenizer(json.loads(text)["text"][:64], return_tensors="pt")
    with torch.no_grad():
        loss = float(model(**batch, labels=batch["input_ids"]).loss)
    assert loss < math.log(256), f"the exported weights are the trained ones (loss {loss})"


def test_fine_tuning_starts_from_a_model_in_s3_without_ray(
    ray_address: str, reference: ReferenceRun, storage: Storage
) -> None:
    """The exported model as the source of a new run (config, weights and tokenizer copied from S3 to the
    node), trained by the per-worker loop in a plain process: the path torchrun and the GPU bench use."""
    config = trainer_config("fine-tune", storage.uri, workers=1, training={"maxSteps": 4})
    config["model"] = {"source": reference.progress.exported_model_uri}
    submission = submit(ray_address, config, None, "--launcher", "direct")
    assert submission.returncode == 0, submission.output[-6000:]
    progress = storage.progress("fine-tune")
    assert progress.phase == "finished" and progress.step == 4 and progress.world_size == 1
    first = losses(storage.history("fine-tune")[-1])[1]
    assert first < reference.losses[1] - 1.0, f"starts from the trained weights, not at random ({first})"


def download(storage: Storage, prefix: str, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for key in storage.keys(prefix):
        storage.client().download_file(storage.bucket, key, str(target / key.rsplit("/", 1)[-1]))
    return target


def test_a_lora_chat_fine_tune_on_two_workers_learns_the_answers(
    ray_address: str, reference: ReferenceRun, storage: Storage, tmp_path: Path
) -> None:
    """Issue 48 end to end: the chat corpus (messages, ChatML, the loss on the assistant turns, packed) and a
    LoRA adapter on the reference run's exported model in S3, on 2 Ray workers: the held-out loss on the
    answers falls, the checkpoints hold the adapter only, and the merged export is base + adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name = "chat-lora"
    config = trainer_config(
        name,
        storage.uri,
        training={
            "maxSteps": 12,
            "sequenceLength": 1024,
            "microBatchSize": 2,
            "learningRate": 1e-2,
            "warmupSteps": 0,
        },
        data={"source": str(CHAT_CORPUS), "format": "messages", "chatTemplate": CHATML, "evalEvery": 4},
    )
    config["model"] = {"source": reference.progress.exported_model_uri}
    config["fsdp"] = {"adapter": {"rank": 4, "alpha": 8, "exportMerged": True}}
    submission = submit(ray_address, config)
    assert submission.returncode == 0, submission.output[-6000:]
    (records,) = storage.history(name)
    progress = records[-1]
    assert progress.phase == "finished" and progress.world_size == 2
    assert progress.training_data is not None and progress.training_data.learned == "assistant turns"
    # Each evaluation (steps 4, 8, 12) as the records after it repeat it.
    evaluated = list(dict.fromkeys(r.eval_loss for r in records if r.eval_loss is not None))
    print(f"eval loss on the answers: {evaluated}; adapter {progress.adapter_bytes} bytes")
    assert len(evaluated) == 3 and evaluated[0] > evaluated[1] > evaluated[2], evaluated

    full = [sum(m.files.values()) for m in storage.checkpoints(reference.name).values() if m is not None]
    adapter_only = [sum(m.files.values()) for m in storage.checkpoints(name).values() if m is not None]
    # The frozen weights and their optimizer state are left out; what remains of a checkpoint this small is
    # mostly what any checkpoint holds (the data streams' cursors, the RNG states, DCP's metadata: about
    # 0.45 MB here). tests/trainer/unit/test_lora.py measures the tensors alone: under 1 %.
    assert adapter_only and max(adapter_only) < 0.5 * min(full), (adapter_only, full)

    run = f"{NAMESPACE}/{name}"
    base = download(storage, f"{reference.name}/{MODEL_DIR}/", tmp_path / "base")
    adapter = download(storage, f"{name}/adapter/", tmp_path / "adapter")
    merged = download(storage, f"{name}/{MODEL_DIR}/", tmp_path / "merged")
    assert run in (progress.exported_model_uri or "")
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
        got = AutoModelForCausalLM.from_pretrained(merged).eval()
        torch.testing.assert_close(
            got(input_ids=tokens).logits, expected(input_ids=tokens).logits, rtol=1e-4, atol=1e-4
        )


# ----------------------------------------------------------------------------------------------------------
# Failures and resumption


def test_killed_worker_is_restarted_and_resumes_from_the_last_checkpoint(
    ray_address: str, storage: Storage, reference: ReferenceRun, tmp_path: Path
) -> None:
    name = "in-job-retry"
    fault = f"rank=1,step=13,marker={tmp_path / 'killed'}"
    submission = submit(ray_address, trainer_config(name, storage.uri, maxFailures=1), fault=fault)
    assert submission.returncode == 0, submission.output[-6000:]
    assert (tmp_path / "killed").exists(), "the fault was never injected"

    first, second = storage.history(name)
    progress = storage.progress(name)
    assert progress.phase == "finished" and progress.step == MAX_STEPS
    assert progress.resumed_from_step == CHECKPOINT_EVERY, "Ray Train restarted from the step-8 checkpoint"
    executed_before = sorted(losses(first))
    executed_after = sorted(losses(second))
    assert executed_before[:CHECKPOINT_EVERY] == list(range(1, CHECKPOINT_EVERY + 1))
    assert executed_after == list(range(CHECKPOINT_EVERY + 1, MAX_STEPS + 1)), (
        "after the restart no step up to the checkpoint may run again"
    )
    assert_same_trajectory(losses(second), reference.losses, range(CHECKPOINT_EVERY + 1, MAX_STEPS + 1))


@dataclass(frozen=True)
class ResubmittedRun:
    name: str
    failed: ProgressRecord
    resumed: ProgressRecord
    resumed_losses: dict[int, float]


@pytest.fixture(scope="module")
def resubmitted(
    ray_address: str, storage: Storage, tmp_path_factory: pytest.TempPathFactory
) -> ResubmittedRun:
    """A first submission loses rank 0 at step 13 with no retries left and fails; a second submission with
    the same run name and storage path follows."""
    name = "resubmitted"
    marker = tmp_path_factory.mktemp("fault") / "killed"
    first = submit(ray_address, trainer_config(name, storage.uri), fault=f"rank=0,step=13,marker={marker}")
    assert first.returncode != 0, "the first submission should fail: its only attempt lost a worker"
    failed = storage.progress(name)
    second = submit(ray_address, trainer_config(name, storage.uri))
    assert second.returncode == 0, second.output[-6000:]
    return ResubmittedRun(name, failed, storage.progress(name), losses(storage.history(name)[-1]))


def test_second_submission_resumes_where_the_first_stopped(
    resubmitted: ResubmittedRun, reference: ReferenceRun
) -> None:
    assert resubmitted.failed.phase == "failed"
    assert resubmitted.failed.error_kind == "runtime", "a lost worker is retryable"
    # Progress is stored in the background at most once a second, so a crash can lose the last second: on a
    # fast machine all 12 steps (seen in CI: the record still said step 0). It never claims a later step.
    assert 0 <= resubmitted.failed.step <= 12, "the failure record keeps the last step stored"
    assert resubmitted.resumed.phase == "finished" and resubmitted.resumed.step == MAX_STEPS
    assert resubmitted.resumed.resumed_from_step == CHECKPOINT_EVERY
    assert sorted(resubmitted.resumed_losses) == list(range(CHECKPOINT_EVERY + 1, MAX_STEPS + 1))
    assert_same_trajectory(
        resubmitted.resumed_losses, reference.losses, range(CHECKPOINT_EVERY + 1, MAX_STEPS + 1)
    )


def test_incomplete_checkpoints_are_skipped_and_training_resumes_on_one_worker(
    ray_address: str, storage: Storage, resubmitted: ResubmittedRun, reference: ReferenceRun
) -> None:
    """The latest checkpoint loses a shard and the one before it its manifest: both are skipped, and the
    oldest complete one is loaded onto a single worker (resharded from two)."""
    name = resubmitted.name
    by_step = {m.step: d for d, m in storage.checkpoints(name).items() if m is not None}
    assert sorted(by_step) == [8, 16, 24], by_step
    storage.delete(f"{RUNS}/{name}/{by_step[24]}/__1_0.distcp")
    storage.delete(f"{RUNS}/{name}/{by_step[16]}/{MANIFEST_FILE}")

    submission = submit(
        ray_address, trainer_config(name, storage.uri, workers=1, training={"maxSteps": MAX_STEPS + 4})
    )
    assert submission.returncode == 0, submission.output[-6000:]
    progress = storage.progress(name)
    assert progress.resumed_from_step == 8, "steps 24 (shard missing) and 16 (no manifest) must be skipped"
    assert progress.world_size == 1
    assert progress.phase == "finished" and progress.step == MAX_STEPS + 4
    resumed = losses(storage.history(name)[-1])
    assert sorted(resumed) == list(range(9, MAX_STEPS + 5))
    assert all(math.isfinite(loss) for loss in resumed.values())
    assert resumed[9] < reference.losses[1] - 0.5, "the weights were restored, not re-initialised"
    assert progress.eval_perplexity is not None
