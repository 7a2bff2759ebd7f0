"""LoRA adapters (fsdp.adapter) through peft: injected into the weightless model before it is sharded, so
FSDP shards the adapter's weights with the rest of each decoder layer; only they are trainable, in the
optimizer, in checkpoints and in the adapter export. The pretrained weights are frozen and always read from
model.source, also on resume.

The names: peft wraps each target linear layer, so its weight becomes `<layer>.base_layer.weight` beside
`<layer>.lora_A.default.weight` and `<layer>.lora_B.default.weight`. The pretrained files and a merged export
use the plain `<layer>.weight`; peft's adapter files `base_model.model.<layer>.lora_A.weight`.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_trainer.contract import ADAPTER_REQUIREMENT, AdapterSpec
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.storage import Location

ADAPTER_NAME = "default"  # peft's name for a model's only adapter
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_LAYER = ".base_layer"
PEFT_PREFIX = "base_model.model."


# peft is imported only where a run has an adapter: the names below serve every run (model.py, checkpoint.py).


def lora_config(spec: AdapterSpec, base_model: str | None = None) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        base_model_name_or_path=base_model,
        task_type="CAUSAL_LM",
    )


def inject(lm: torch.nn.Module, spec: AdapterSpec) -> None:
    """Adds the adapter to the weightless (meta) model and freezes everything else (peft's doing)."""
    try:
        from peft import inject_adapter_in_model
    except ImportError as error:  # a configuration to fix, not a failure a restart can mend
        raise ConfigError(
            f"fsdp.adapter needs {ADAPTER_REQUIREMENT}, which this environment lacks: the operator asks Ray "
            "to install it (the job's runtime env pip), which needs a package index the pods can reach, or "
            f"an image that has it ({error})"
        ) from error

    try:
        inject_adapter_in_model(lora_config(spec), lm, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # peft: no module matched the targets
        raise ConfigError(f"fsdp.adapter.targetModules: {error}") from error


def initialise(lm: torch.nn.Module) -> None:
    """peft's initialisation once the model has storage: A random (Kaiming), B zero, so the adapted model
    starts as the pretrained one."""
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module in lm.modules():
            if isinstance(module, LoraLayer):
                layer: Any = module  # peft's methods are untyped
                layer.reset_lora_parameters(ADAPTER_NAME, init_lora_weights=True)


def load_exported(lm: torch.nn.Module, spec: AdapterSpec, directory: str) -> None:
    """Replaces the new adapter's weights with those of an adapter exported by export_adapter (peft's
    format) in `directory`; each rank keeps its shard of them."""
    from safetensors.torch import load_file

    source = f"fsdp.adapter.initFrom {spec.init_from}"
    try:
        with open(os.path.join(directory, "adapter_config.json"), encoding="utf-8") as file:
            saved = json.load(file)
        weights = load_file(os.path.join(directory, ADAPTER_WEIGHTS))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{source}: not an exported adapter: {error}") from error
    if (saved.get("r"), saved.get("lora_alpha")) != (spec.rank, spec.alpha):
        raise ConfigError(
            f"{source} has rank {saved.get('r')} and alpha {saved.get('lora_alpha')}; this run's adapter "
            f"{spec.rank} and {spec.alpha}"
        )
    with torch.no_grad():
        for name, parameter in lm.named_parameters():
            if not is_adapter_weight(name):
                continue
            full = weights.get(peft_name(name))
            if full is None or tuple(full.shape) != tuple(parameter.shape):
                raise ConfigError(
                    f"{source} has no weight {peft_name(name)} of shape {tuple(parameter.shape)}"
                )
            value = full.to(parameter.device, parameter.dtype)
            if isinstance(parameter, DTensor):
                value = distribute_tensor(value, parameter.device_mesh, parameter.placements)
            parameter.copy_(value)


def peft_name(name: str) -> str:
    """An adapter weight's name in peft's files."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def is_adapter_weight(name: str) -> bool:
    return ".lora_" in name


def pretrained_name(name: str) -> str:
    """A base weight's name in the pretrained files."""
    return name.replace(BASE_LAYER, "")


def trainable_bytes(lm: torch.nn.Module) -> int:
    """The adapter's size in fp32, the dtype it trains and is checkpointed in (a DTensor counts whole)."""
    return sum(p.numel() * p.element_size() for p in lm.parameters() if p.requires_grad)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def adapter_state(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's full weights under peft's names (a collective: every rank calls it)."""
    return {
        peft_name(name): _full(parameter.detach()).cpu().contiguous()
        for name, parameter in lm.named_parameters()
        if is_adapter_weight(name)
    }


def export_adapter(
    lm: torch.nn.Module, spec: AdapterSpec, base_model: str | None, run: Location, rank: int
) -> str:
    """The adapter as peft saves one (adapter_model.safetensors, adapter_config.json) under <run>/adapter/,
    written by rank 0: `PeftModel.from_pretrained(base, path)` loads it."""
    weights = adapter_state(lm)
    destination = run.child(ADAPTER_DIR)
    if rank == 0:
        with tempfile.TemporaryDirectory() as local:
            save_file(weights, os.path.join(local, ADAPTER_WEIGHTS), metadata={"format": "pt"})
            lora_config(spec, base_model).save_pretrained(local)
            destination.upload_from(local)
    return destination.uri


def merged_state(lm: torch.nn.Module, spec: AdapterSpec) -> dict[str, Any]:
    """The sharded state of the base model with each adapted weight replaced by W + (alpha / rank) B A, under
    the pretrained names: what export.export_model writes for a merged export. The model is left as it is."""
    scale = spec.alpha / spec.rank
    state: dict[str, Any] = {}
    modules = dict(lm.named_modules())
    for name, parameter in lm.named_parameters():
        if is_adapter_weight(name):
            continue
        tensor = parameter.detach()
        layer_name, _, leaf = name.rpartition(".")
        if layer_name.endswith(BASE_LAYER) and leaf == "weight":
            layer = modules[layer_name.removesuffix(BASE_LAYER)]
            a = _full(layer.lora_A[ADAPTER_NAME].weight.detach()).float()
            b = _full(layer.lora_B[ADAPTER_NAME].weight.detach()).float()
            delta = (b @ a) * scale
            if isinstance(tensor, DTensor):
                delta = distribute_tensor(delta.to(tensor.device), tensor.device_mesh, tensor.placements)
            tensor = tensor + delta.to(tensor.dtype)
        state[pretrained_name(name)] = tensor
    return state


def describe(lm: torch.nn.Module) -> str:
    """For the log: the adapter's share of the model."""
    total = sum(p.numel() for p in lm.parameters())
    trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    return json.dumps({"adapter_parameters": trainable, "of": total, "bytes": trainable_bytes(lm)})
