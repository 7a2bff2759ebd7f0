"""S3 lost in the middle of checkpoint uploads: the trainer's asynchronous saver against the local S3 server,
behind a proxy that resets every connection, as a killed server's kernel does, and every new one until the
save has given up. Twenty saves, each cut at a different point (from staging to the manifest). The points are
bytes of the save's upload, not times: a time measured on a loaded machine missed half the uploads of saves
that ran faster later (CI, 9 of 20 cut).

The S3 server itself is not killed: moto keeps its objects in memory, so killing it would lose the complete
checkpoints as well, which no real S3 outage does. What the trainer sees is the same: connections reset, then
refused, then a server that answers again with everything written before the outage.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import boto3
import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist

from fsdp_trainer import checkpoint
from fsdp_trainer.contract import MANIFEST_FILE, Versions
from fsdp_trainer.storage import Location
from tests.support.net import free_port
from tests.support.netproxy import BlackHoleProxy
from tests.support.reliability import Recorder

TRIALS = 20
KEEP = 3
FINGERPRINT, DATA = "0123456789abcdef", "data-0"


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def app_state() -> checkpoint.AppState:
    """About 25 MB of checkpoint (weights and AdamW moments), so that an upload takes long enough to cut."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(2)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return checkpoint.AppState(model, optimizer, scheduler, checkpoint.TrainState())


def train_step(app: checkpoint.AppState) -> None:
    app.model(torch.randn(8, 1024)).square().mean().backward()
    app.optimizer.step()
    app.scheduler.step()
    app.optimizer.zero_grad()
    app.train.step += 1


def weights(app: checkpoint.AppState) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in app.model.named_parameters()}


def complete_steps(run: Location) -> set[int]:
    return {
        c.manifest.step
        for c in checkpoint.complete_oldest_first(checkpoint.run_checkpoints(run))
        if c.manifest
    }


def resumed(run: Location) -> tuple[int, dict[str, torch.Tensor]] | None:
    """What a new attempt would resume from, loaded as the trainer loads it."""
    found = checkpoint.find_resume_point(run, "auto", "next-attempt", FINGERPRINT, DATA)
    if found is None or found.manifest is None:
        return None
    target = app_state()
    checkpoint.load(Location.parse(found.location.uri), target, 0, reseed=0)
    return found.manifest.step, weights(target)


def test_a_checkpoint_cut_by_an_s3_outage_is_never_resumed_and_nothing_complete_is_lost(
    s3_endpoint: str, tmp_path: Path, reliability: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = f"outage-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
    )
    server = urlparse(s3_endpoint)
    assert server.hostname and server.port
    with BlackHoleProxy(server.hostname, server.port) as proxy:
        # No retries: the saver's handling of a failed upload is under test, not the S3 client's backoff
        # (with its default retries each cut save takes 1 to 5 s to give up).
        through_proxy = pafs.S3FileSystem(
            endpoint_override=proxy.url, scheme="http", access_key="testing", secret_key="testing",
            region="us-west-2", connect_timeout=2, request_timeout=5,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
        )  # fmt: skip
        # The shards' upload (boto3's transfer manager) takes its endpoint and retries from the environment,
        # as on a node: through the proxy too, or the outage cuts only the listing and the manifest.
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        run = Location(through_proxy, f"{bucket}/runs/outage", f"s3://{bucket}/runs/outage")
        identity = checkpoint.SaveIdentity("outage", "job-1", FINGERPRINT, DATA, 1, Versions())
        saver = checkpoint.CheckpointSaver(run, identity, 0, keep=KEEP, device=torch.device("cpu"))
        app = app_state()
        saved: dict[int, dict[str, torch.Tensor]] = {}
        try:
            # The bytes one save sends S3, the fewest of four (pruning old checkpoints adds a few): every cut
            # below falls inside the upload, before its manifest.
            uploads = []
            for _ in range(4):
                train_step(app)
                sent = proxy.sent_bytes
                saver.start(app, checkpoint.checkpoint_name(app.train.step, "a"), loss=None)
                saver.wait()
                uploads.append(proxy.sent_bytes - sent)
                saved[app.train.step] = weights(app)
            save_bytes = min(uploads)
            failed, cut_mid_upload, manifest_despite_error = 0, 0, 0
            before, complete_before = resumed(run), complete_steps(run)
            for trial in range(TRIALS):
                assert before is not None
                train_step(app)
                step = app.train.step
                saved[step] = weights(app)
                name = checkpoint.checkpoint_name(step, "a")
                # From staging (0 bytes) to the last part before the manifest; crashed until the save has
                # given up or finished: S3 comes back after that.
                proxy.crash_after(save_bytes * trial // TRIALS)
                saver.start(app, name, loss=None)
                try:
                    saver.wait()
                    succeeded = True
                except OSError:
                    succeeded, failed = False, failed + 1
                finally:
                    proxy.pass_through()
                after = resumed(run)
                assert after is not None, f"trial {trial}: no checkpoint to resume from"
                resumed_step, resumed_weights = after
                left = run.child(name).list_files()
                if succeeded:
                    assert resumed_step == step, f"trial {trial}: a save that succeeded is not the newest"
                elif resumed_step == step:  # the manifest landed and only its answer was lost
                    manifest_despite_error += 1
                else:
                    assert resumed_step == before[0], (
                        f"trial {trial}: resumed {resumed_step}, not {before[0]}"
                    )
                    assert MANIFEST_FILE not in left, f"trial {trial}: a manifest the resume point ignored"
                    cut_mid_upload += bool(left)
                # Exactly the state saved at that step: never a partial checkpoint, never a lost one.
                for parameter, value in saved[resumed_step].items():
                    assert torch.equal(resumed_weights[parameter], value), (trial, resumed_step, parameter)
                # Pruning keeps the newest KEEP complete checkpoints, and an outage deletes none of them.
                complete_after = complete_steps(run)
                kept = sorted(complete_before | ({step} & complete_after))[-KEEP:]
                assert set(kept) <= complete_after, f"trial {trial}: lost {set(kept) - complete_after}"
                before, complete_before = after, complete_after
        finally:
            saver.close()
    print(f"save {save_bytes} bytes; failed {failed}, partial {cut_mid_upload}, "
          f"manifest despite an error {manifest_despite_error}")  # fmt: skip
    assert failed == TRIALS, f"only {failed} of {TRIALS} saves cut before their manifest failed"
    assert cut_mid_upload >= 3, f"only {cut_mid_upload} saves left partial files behind"
    reliability.record(
        f"S3 lost (every connection reset until the save gives up) at {TRIALS} points of a checkpoint save, "
        "from staging to the manifest, then back",
        "the save fails; the cut checkpoint is never resumed from; the newest complete one loads exactly",
        f"{failed} of {TRIALS} saves failed, {cut_mid_upload} leaving partial files; "
        f"{manifest_despite_error} completed though their answer was lost; every resume loaded the exact "
        "weights of the newest complete step",
    )
