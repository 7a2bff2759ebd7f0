"""A resume from S3 reads only what each rank needs (issue 34 item 4): two ranks, each a node of its own
(gloo, CPU, FSDP2 over a tiny Qwen2), save a checkpoint to the local S3 server and load it back, each through
a proxy of its own that counts the bytes S3 sends it. Before, every node copied the whole checkpoint; now
each rank reads the checkpoint's metadata, its own RNG file and the stored items its shards need."""

from __future__ import annotations

import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from fsdp_trainer import checkpoint, optim, parallelize
from fsdp_trainer.contract import MANIFEST_FILE, CheckpointManifest, FsdpSpec, TrainingSpec, Versions
from fsdp_trainer.storage import Location
from tests.support.net import free_port
from tests.support.netproxy import BlackHoleProxy
from tests.support.tiny_model import tiny_lm

WORLD = 2


def sharded_app(seed: int) -> checkpoint.AppState:
    """Every parameter has at least 2 rows, so that each rank holds a non-empty shard of each."""
    model = tiny_lm(seed, vocab_size=512, hidden_size=128, intermediate_size=256)
    mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=WORLD), "cpu")
    parallelize.parallelize(model, FsdpSpec(), mesh, torch.float32)
    spec = TrainingSpec()
    optimizer = optim.build_optimizer(model, spec)
    scheduler = optim.build_scheduler(optimizer, spec)
    return checkpoint.AppState(model, optimizer, scheduler, checkpoint.TrainState())


def local_state(app: checkpoint.AppState) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and optimizer moments."""
    names = {id(p): name for name, p in app.model.named_parameters()}
    state = {name: p.to_local().detach().clone() for name, p in app.model.named_parameters()}
    for parameter, moments in app.optimizer.state.items():
        for key, value in moments.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            state[f"{names[id(parameter)]}.{key}"] = local.detach().clone()
    return state


def resume_on_a_node_of_its_own(rank: int, port: int, uri: str, endpoint: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    dist.init_process_group("gloo")
    try:
        app = sharded_app(seed=1)
        batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(rank))
        app.model(input_ids=batch, labels=batch).loss.backward()
        app.optimizer.step()
        app.train.step = 1
        identity = checkpoint.SaveIdentity("run", "job-1", "f" * 16, "data-0", WORLD, Versions())
        saver = checkpoint.CheckpointSaver(
            Location.parse(uri), identity, rank, keep=3, device=torch.device("cpu")
        )
        saver.start(app, checkpoint.checkpoint_name(1, "a"), loss=None, global_batch=4)
        saver.wait()
        saver.close()
        saved = local_state(app)
        dist.barrier()

        os.environ["AWS_ENDPOINT_URL"] = endpoint  # from here on, this rank's S3 traffic is counted
        resumed = sharded_app(seed=2)
        loaded = checkpoint.load(
            Location.parse(f"{uri}/{checkpoint.checkpoint_name(1, 'a')}"), resumed, rank, reseed=0
        )
        restored = local_state(resumed)
        same = saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
        Path(out).write_text(
            json.dumps(
                {
                    "bytes_read": loaded.bytes_read,
                    "reads": loaded.reads,
                    "rng": loaded.rng_restored,
                    "identical": same,
                    "step": resumed.train.step,
                }
            )
        )
    finally:
        dist.destroy_process_group()


def expected_reads(metadata: Metadata, metadata_size: int, rng_size: int, rank: int) -> int:
    """The bytes a rank must read to load the checkpoint at the world size it was written at: the metadata
    (every rank plans from it), its RNG file, and of the shard files: every item that is not a sharded
    tensor's chunk (scheduler and loop state, an optimizer's step count: one item, which every rank loads),
    and of each sharded tensor the chunk this rank wrote, which is exactly its shard at this world size."""
    total = metadata_size + rng_size
    for index, info in metadata.storage_data.items():
        stored = metadata.state_dict_metadata[index.fqn]
        sharded = not isinstance(stored, BytesStorageMetadata) and len(stored.chunks) > 1
        if not sharded or info.relative_path.startswith(f"__{rank}_"):
            total += info.length
    return total


def test_each_rank_reads_its_own_ranges_of_a_checkpoint_in_s3_not_the_whole_checkpoint(
    s3_endpoint: str, tmp_path: Path
) -> None:
    bucket = f"reads-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    uri = f"s3://{bucket}/runs/run-1"
    server = urlparse(s3_endpoint)
    assert server.hostname and server.port
    proxies = [BlackHoleProxy(server.hostname, server.port).start() for _ in range(WORLD)]
    try:
        context = multiprocessing.get_context("spawn")
        port = free_port()
        ranks = [
            context.Process(
                target=resume_on_a_node_of_its_own,
                args=(rank, port, uri, proxies[rank].url, str(tmp_path / f"rank{rank}.json")),
            )
            for rank in range(WORLD)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=600)
        assert [process.exitcode for process in ranks] == [0] * WORLD
        received = [proxy.answered_bytes for proxy in proxies]
    finally:
        for proxy in proxies:
            proxy.close()

    prefix = f"runs/run-1/{checkpoint.checkpoint_name(1, 'a')}"
    manifest = CheckpointManifest.model_validate_json(
        s3.get_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_FILE}")["Body"].read()
    )
    stored = {
        obj["Key"].rsplit("/", 1)[-1]: obj["Size"]
        for obj in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")["Contents"]
    }
    whole = sum(stored.values())  # what a node copied before: every object of the checkpoint
    assert whole == sum(manifest.files.values()) + stored[MANIFEST_FILE]
    assert manifest.global_batch_size == 4
    raw_metadata = s3.get_object(Bucket=bucket, Key=f"{prefix}/.metadata")["Body"].read()
    metadata = pickle.loads(raw_metadata)
    results: list[dict[str, Any]] = [
        json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)
    ]
    for rank, result in enumerate(results):
        assert result["identical"] and result["rng"] and result["step"] == 1, result
        expected = expected_reads(metadata, len(raw_metadata), stored[f"rng_rank{rank:05d}.pt"], rank)
        print(
            f"rank {rank}: read {result['bytes_read']} bytes in {result['reads']} reads "
            f"(expected {expected}); S3 sent it {received[rank]} bytes with HTTP framing; "
            f"the whole checkpoint is {whole} bytes"
        )
        assert result["bytes_read"] == expected
        # What crossed this rank's proxy: the payload plus HTTP headers (and a HEAD for each file opened),
        # under the whole checkpoint a node copied before, and under what this rank's share explains.
        assert expected <= received[rank] < whole
        assert received[rank] < expected + 50_000, "more than headers on top of the ranges read"


@pytest.mark.parametrize(
    ("items", "merged"),
    [
        ([(0, 10), (10, 5), (15, 1)], [(0, 16)]),  # adjacent: one read
        ([(20, 5), (0, 10)], [(0, 10), (20, 5)]),  # a gap: two reads, by offset
        ([(0, 10), (0, 10), (2, 3)], [(0, 10)]),  # the same bytes twice: read once
    ],
)
def test_adjacent_items_are_read_as_one_range(
    items: list[tuple[int, int]], merged: list[tuple[int, int]]
) -> None:
    class Info:
        def __init__(self, offset: int, length: int) -> None:
            self.offset, self.length = offset, length

    ranges = checkpoint.merged_ranges([(Info(offset, length), object()) for offset, length in items])  # type: ignore[misc]
    assert [(start, length) for start, length, _ in ranges] == merged
    assert sum(len(members) for _, _, members in ranges) == len(items)


def test_a_range_larger_than_the_limit_is_split_at_item_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "RANGE_LIMIT", 16)

    class Info:
        def __init__(self, offset: int, length: int) -> None:
            self.offset, self.length = offset, length

    items = [(Info(offset, 6), object()) for offset in range(0, 30, 6)]
    ranges = checkpoint.merged_ranges(items)  # type: ignore[arg-type]
    assert [(start, length) for start, length, _ in ranges] == [(0, 12), (12, 12), (24, 6)]
