"""What a worker writes to its node's disk, so that `spec.cluster.ephemeralStorage` can default to it.

A worker's /tmp holds, at its peak (the trainer's checkpoint.py, checkpoint_manager.py and model.py):
- the model as downloaded (hub or s3://, once per node): bf16 safetensors, 2 bytes per parameter;
- either the whole checkpoint copied to the node on resume (fp32 parameters and AdamW's two fp32 moments,
  12 bytes per parameter, removed once loaded), or, while training, this node's shards of the checkpoint being
  written before their upload plus the consolidated export on rank 0's node;
- Ray's session logs, the job's package and object spilling (a fixed allowance).
The sum gets a quarter more for what the estimate leaves out (tokenizer, the data shard being read).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from fsdp_operator import quantity
from fsdp_trainer.contract import ModelSpec, Precision

GIB = 2**30
DOWNLOADED_BYTES_PER_PARAMETER = 2
CHECKPOINT_BYTES_PER_PARAMETER = 12
EXPORT_BYTES_PER_PARAMETER = {Precision.BF16: 2, Precision.FP16: 2, Precision.FP32: 4}
RAY_ALLOWANCE = 8 * GIB
HEADROOM = 1.25
# A model whose size neither its config nor its name tells: the default before sizes were derived.
UNKNOWN_SIZE = 200 * GIB

# "Qwen2.5-1.5B", "Llama-3.1-8B-Instruct", "Mixtral-8x7B", "SmolLM2-360M": the size hub ids carry.
_SIZE_IN_NAME = re.compile(r"(?<![\w.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BM])(?![a-zA-Z])")
_SCALE = {"B": 10**9, "M": 10**6}


@dataclass(frozen=True)
class DiskPlan:
    """A worker's local disk at its peak, in bytes, by what it holds; parameters None when unknown."""

    parameters: int | None
    model_cache: int = 0
    resume_copy: int = 0
    checkpoint_shards: int = 0
    export: int = 0

    @property
    def size(self) -> int:
        if self.parameters is None:
            return UNKNOWN_SIZE
        peak = self.model_cache + max(self.resume_copy, self.checkpoint_shards + self.export)
        return _whole_gib(peak * HEADROOM + RAY_ALLOWANCE)

    @property
    def quantity(self) -> str:
        return f"{self.size // GIB}Gi"

    def explain(self) -> str:
        """What the size is made of, for a message that says why a worker asks for that much disk."""
        if self.parameters is None:
            return (
                f"{quantity.human_bytes(UNKNOWN_SIZE)}: the model's size is in neither model.fromConfig "
                "nor the name of model.source"
            )
        parts = [
            f"{_shown(self.model_cache)} model download" if self.model_cache else "",
            f"{_shown(self.resume_copy)} checkpoint copied whole on resume",
            f"or {_shown(self.checkpoint_shards)} of checkpoint shards being written"
            + (f" and a {_shown(self.export)} export" if self.export else ""),
            f"{_shown(RAY_ALLOWANCE)} for Ray",
        ]
        billions = self.parameters / 10**9
        return (
            f"{self.quantity} for a {billions:.3g}B-parameter model: "
            + ", ".join(part for part in parts if part)
            + f", plus {HEADROOM - 1:.0%}"
        )


def plan(model: ModelSpec, precision: Precision, workers: int) -> DiskPlan:
    parameters = parameter_count(model)
    if parameters is None:
        return DiskPlan(parameters=None)
    checkpoint = parameters * CHECKPOINT_BYTES_PER_PARAMETER
    downloaded = model.source is not None and not model.source.startswith("/")
    return DiskPlan(
        parameters=parameters,
        model_cache=parameters * DOWNLOADED_BYTES_PER_PARAMETER if downloaded else 0,
        resume_copy=checkpoint,
        checkpoint_shards=math.ceil(checkpoint / workers),
        export=parameters * EXPORT_BYTES_PER_PARAMETER[precision],
    )


def parameter_count(model: ModelSpec) -> int | None:
    """From model.fromConfig (a decoder-only transformer's shape), else from the size in model.source's
    name; None when neither tells."""
    if model.from_config is not None:
        return _from_config(model.from_config)
    if model.source is None:
        return None
    sizes = [
        int(float(size) * _SCALE[unit] * int(experts or 1))
        for experts, size, unit in _SIZE_IN_NAME.findall(model.source.rstrip("/").rsplit("/", 1)[-1])
    ]
    return max(sizes, default=None)


def _from_config(config: dict[str, Any]) -> int | None:
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
    values = [config.get(name) for name in fields]
    if not all(isinstance(value, int) and value > 0 for value in values):
        return None
    vocab, hidden, layers, intermediate, heads = (int(v) for v in values if isinstance(v, int))
    kv_heads = config.get("num_key_value_heads")
    kv_width = hidden * kv_heads // heads if isinstance(kv_heads, int) and 0 < kv_heads <= heads else hidden
    attention = 2 * hidden * hidden + 2 * hidden * kv_width
    mlp = 3 * hidden * intermediate
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp)


def _whole_gib(amount: float) -> int:
    return math.ceil(amount / GIB) * GIB


def _shown(amount: int) -> str:
    return quantity.human_bytes(_whole_gib(amount) if amount >= GIB else amount)
