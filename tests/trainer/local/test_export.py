"""The exported model (issue 34 item 4): written by every rank, each holding one full tensor at a time, never
the full state; the files are a Hugging Face model that from_pretrained loads with the trained weights. Two
ranks (gloo, CPU, FSDP2 over a tiny Qwen2 with tied embeddings), the weight files split small so that each
rank writes some."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
from transformers import AutoModelForCausalLM

from fsdp_trainer import export, parallelize
from fsdp_trainer.contract import FsdpSpec
from fsdp_trainer.model import byte_level_tokenizer
from fsdp_trainer.storage import Location
from tests.support.net import free_port
from tests.support.tiny_model import tiny_lm

WORLD = 2


def export_on_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    dist.init_process_group("gloo")
    try:
        model = tiny_lm(hidden_size=64, intermediate_size=128)
        mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=WORLD), "cpu")
        parallelize.parallelize(model, FsdpSpec(), mesh, torch.float32)
        with torch.no_grad():  # weights no initialisation gives: the export must carry these
            for parameter in model.parameters():
                parameter.add_(0.25)
        reference = {name: p.full_tensor().to(torch.bfloat16) for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(reference, os.path.join(out, "reference.pt"))
        del reference

        def sharded_only(*args: Any, **kwargs: Any) -> Any:
            options = kwargs.get("options")
            assert options is None or not options.full_state_dict, "the full state gathered"
            return real(*args, **kwargs)

        real, export.get_model_state_dict = export.get_model_state_dict, sharded_only  # type: ignore[assignment]
        export.SHARD_BYTES = 60_000  # several files: each rank writes some
        exported = export.export_model(
            model, model.config, byte_level_tokenizer(), torch.bfloat16,
            Location.parse(os.path.join(out, "model")), rank, WORLD,
        )  # fmt: skip
        Path(out, f"rank{rank}.json").write_text(
            json.dumps(
                {"files": exported.files, "peak": exported.peak_tensor_bytes, "total": exported.total_bytes}
            )
        )
    finally:
        dist.destroy_process_group()


def test_every_rank_writes_part_of_the_export_and_none_holds_the_full_state(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model-00009-of-00009.safetensors").write_text("an earlier export's file")
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=export_on_rank, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=600)
    assert [process.exitcode for process in ranks] == [0] * WORLD
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    state = model.state_dict()
    for name, value in reference.items():
        assert torch.equal(state[name].to(torch.bfloat16), value), name
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert model.config.dtype == torch.bfloat16

    index = json.loads((model_dir / export.INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert "lm_head.weight" not in index["weight_map"], (
        "a tied weight is stored once, as save_pretrained does"
    )
    written = [file for result in results for file in result["files"]]
    assert sorted(written) == files and all(result["files"] for result in results), "each rank wrote files"
    assert not (model_dir / "model-00009-of-00009.safetensors").exists(), "the earlier export's file is gone"
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in model_dir.iterdir()
    }

    # What a rank holds at once is one full tensor in bf16, the largest it gathered (the embedding, 320 x 64 x
    # 2 bytes); before, rank 0 gathered the whole state in fp32 (twice the bf16 total) and cast it.
    largest = max(value.nbytes for value in reference.values())
    total = results[0]["total"]
    print(f"export: each rank held at most {[r['peak'] for r in results]} bytes of a {total}-byte bf16 model")
    assert all(result["peak"] == largest for result in results)
    assert largest < total / 4
