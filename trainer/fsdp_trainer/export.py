"""The trained model exported as a Hugging Face model (safetensors, config, generation config, tokenizer),
written by every rank: no rank ever holds more than one full tensor of it.

The files are those `save_pretrained` writes (the same tensor names, tied weights dropped as it drops them,
the same split into files with its index), planned on a weightless copy of the architecture. Then, tensor by
tensor in one order on every rank, each sharded weight is cast to the export dtype on its shard and
all-gathered (DTensor.full_tensor); the rank that writes the file holding it appends it to that file, the
others drop it. Files go to ranks in turn, so a large model's files are written and uploaded in parallel.
Rank 0 also writes the config, the tokenizer and the index, after every rank's files are in storage, and
then deletes what an earlier export left that this one did not write (the export is replaced, never emptied
first). Before this, rank 0 gathered the full fp32 state in its host memory (about 280 GB at 70B).

A model whose transformers class converts weights on save (not only renames them: fused MoE experts) is
exported the old way, gathered whole on rank 0: a converter may combine several tensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from fsdp_trainer.storage import Location

log = logging.getLogger(__name__)

# The most bytes of tensors per safetensors file (the Hub's usual 5 GB; transformers' default is 50 GB): more
# files than ranks spreads the writing, and a rank holds one tensor at a time whatever the file size.
SHARD_BYTES = 5 * 10**9
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class Exported:
    """One rank's part of an export: the files it wrote, and the most bytes of full tensors it held at once
    (one tensor: the largest it gathered)."""

    files: list[str]
    peak_tensor_bytes: int
    total_bytes: int


def export_model(
    lm: torch.nn.Module,
    model_config: Any,
    tokenizer: Any,
    dtype: torch.dtype,
    destination: Location,
    rank: int,
    world_size: int,
    state: dict[str, Any] | None = None,
) -> Exported:
    """Writes the model to `destination`; every rank calls it at the same point (it runs collectives).
    `state`: this rank's shards to write instead of the model's own (an adapter merged into its base)."""
    from fsdp_trainer.model import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    shell.tie_weights()
    # This rank's shards (DTensors), under the model's own names.
    sharded = get_model_state_dict(lm) if state is None else state
    names = _saved_names(shell, sharded)
    if names is None:
        log.warning(
            "transformers converts %s's weights on save: exporting through rank 0", type(shell).__name__
        )
        return _export_gathered(lm, shell, tokenizer, dtype, destination, rank)
    from huggingface_hub import split_torch_state_dict_into_shards

    planned = {name: _meta(sharded[name], dtype) for name in names}
    split = split_torch_state_dict_into_shards(
        planned, filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=SHARD_BYTES,
    )  # fmt: skip
    files = sorted(split.filename_to_tensors)
    mine = {file for index, file in enumerate(files) if index % world_size == rank}
    previous = destination.list_files() if rank == 0 else {}
    local_dir = tempfile.mkdtemp(prefix="fsdp-export-")
    failure: str | None = None
    peak = 0
    try:
        writers: dict[str, _SafetensorsWriter] = {}
        try:
            for file in sorted(mine):
                entries = [(name, planned[name]) for name in names if split.tensor_to_filename[name] == file]
                writers[file] = _SafetensorsWriter(os.path.join(local_dir, file), entries)
        except OSError as error:
            failure = f"rank {rank}: {type(error).__name__}: {error}"
        for name in names:  # the same order on every rank: each full_tensor is a collective
            value = sharded[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} is a {type(value).__name__} in the model's state dict, not a tensor")
            cast = value.detach().to(dtype)
            full = cast.full_tensor() if isinstance(cast, DTensor) else cast
            writer = writers.get(split.tensor_to_filename[name])
            if writer is not None and failure is None:
                full = full.cpu()
            if full.device.type == "cpu":  # in host memory (on a CPU run every rank's gathered copy is)
                peak = max(peak, full.nbytes)
            if writer is not None and failure is None:
                try:
                    writer.write(full)
                except OSError as error:
                    failure = f"rank {rank}: {type(error).__name__}: {error}"
            del full
        try:
            for writer in writers.values():
                writer.close()
            if failure is None and mine:
                destination.upload_from(local_dir)
        except OSError as error:
            failure = f"rank {rank}: {type(error).__name__}: {error}"
        failures: list[Any] = [None] * world_size
        dist.all_gather_object(failures, failure)  # every rank's files are in storage, or it says why not
        if any(failures):
            raise OSError(f"exporting to {destination.uri} failed: {'; '.join(f for f in failures if f)}")
        if rank == 0:
            shutil.rmtree(local_dir)
            os.makedirs(local_dir)
            written = _write_config(shell, tokenizer, dtype, local_dir)
            if split.is_sharded:
                index = {
                    "metadata": {"total_parameters": shell.num_parameters(), **split.metadata},
                    "weight_map": split.tensor_to_filename,
                }
                with open(os.path.join(local_dir, INDEX_NAME), "w", encoding="utf-8") as index_file:
                    index_file.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
                written.append(INDEX_NAME)
            destination.upload_from(local_dir)
            for stale in sorted(set(previous) - set(files) - set(written)):
                destination.fs.delete_file(destination.child(stale).path)
            log.info(
                "exported the model to %s (%d weight files from %d ranks)",
                destination.uri,
                len(files),
                world_size,
            )
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    dist.barrier()
    return Exported(sorted(mine), peak, sum(t.nbytes for t in planned.values()))


def _saved_names(shell: Any, sharded: dict[str, Any]) -> list[str] | None:
    """The names save_pretrained would write, in the model's state-dict order (tied aliases dropped as it
    drops them), or None when transformers would convert the weights rather than only keep their names."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    parameters = dict(shell.named_parameters(remove_duplicate=False))
    meta = dict(shell.state_dict())
    kept = remove_tied_weights_from_state_dict({n: t for n, t in meta.items() if n in parameters}, shell)
    kept.update({n: t for n, t in meta.items() if n not in parameters})  # persistent buffers
    missing = set(kept) - set(sharded)
    if missing:
        raise KeyError(f"the trained model lacks {sorted(missing)[:5]} of its architecture's state")
    reverted = revert_weight_conversion(shell, dict(kept))
    if set(reverted) != set(kept) or any(reverted[name] is not kept[name] for name in kept):
        return None
    return [name for name in sharded if name in kept]


def _meta(value: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(value.shape, dtype=dtype, device="meta")


class _SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (names, dtypes, shapes, offsets) is known from
    the plan, so each tensor is appended as it arrives and only one is ever in memory."""

    def __init__(self, path: str, entries: list[tuple[str, torch.Tensor]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, planned in entries:
            size = planned.numel() * planned.element_size()
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[planned.dtype],
                "shape": list(planned.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.expected = [(name, planned.shape, planned.dtype) for name, planned in entries]
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115  (closed by close())
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, tensor: torch.Tensor) -> None:
        name, shape, dtype = self.expected.pop(0)
        if tensor.shape != shape or tensor.dtype != dtype:
            raise ValueError(
                f"{name}: planned {tuple(shape)} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        self.file.close()
        if self.expected:
            raise OSError(f"{self.file.name}: {len(self.expected)} tensors never written")


def _write_config(shell: Any, tokenizer: Any, dtype: torch.dtype, local_dir: str) -> list[str]:
    """What save_pretrained writes besides the weights (config, generation config), and the tokenizer."""
    shell.config.dtype = str(dtype).split(".")[1]
    shell.config.architectures = [type(shell).__name__]
    shell.config.save_pretrained(local_dir)
    if shell.can_generate():
        shell.generation_config.save_pretrained(local_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(local_dir)
    return sorted(os.listdir(local_dir))


def _export_gathered(
    lm: torch.nn.Module, shell: Any, tokenizer: Any, dtype: torch.dtype, destination: Location, rank: int
) -> Exported:
    """The whole state gathered to rank 0's host and saved by save_pretrained (models whose weights
    transformers converts on save)."""
    full_state = get_model_state_dict(lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    total = sum(v.nbytes for v in full_state.values() if isinstance(v, torch.Tensor))
    if rank == 0:
        weights = {k: v.to(dtype) for k, v in full_state.items() if isinstance(v, torch.Tensor)}
        shell.load_state_dict(weights, assign=True)
        shell.tie_weights()
        with tempfile.TemporaryDirectory(prefix="fsdp-export-") as local_dir:
            shell.save_pretrained(local_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(local_dir)
            destination.replace_with(local_dir)
        log.info("exported the model to %s", destination.uri)
    dist.barrier()
    return Exported([], total if rank == 0 else 0, total)
