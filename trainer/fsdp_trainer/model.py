"""Tokenizer and causal LM loading: hub id, local directory, s3:// prefix (downloaded once per node), or a
random initialisation from a config dict, plus the built-in byte-level tokenizer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from fsdp_trainer.contract import ModelSpec
from fsdp_trainer.errors import ConfigError, ModelError
from fsdp_trainer.metrics import ModelShape
from fsdp_trainer.storage import node_local_copy

log = logging.getLogger(__name__)

# transformers' auto classes and fast tokenizer have untyped constructors; mypy sees them as Any here.
AutoConfig: Any = transformers.AutoConfig
AutoModelForCausalLM: Any = transformers.AutoModelForCausalLM
AutoTokenizer: Any = transformers.AutoTokenizer
PreTrainedTokenizerFast: Any = transformers.PreTrainedTokenizerFast

BYTE_LEVEL = "byte-level"
END_OF_TEXT = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which tokenizers' ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def byte_level_tokenizer() -> PreTrainedTokenizerBase:
    """256 byte tokens (id == byte value) and <|endoftext|> (id 256); no merges, nothing to download."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab[END_OF_TEXT] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    wrapped: PreTrainedTokenizerBase = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=END_OF_TEXT
    )
    return wrapped


def resolve(source: str, local_rank: int, barrier: Callable[[], None]) -> str:
    """A loadable path: s3:// prefixes are copied to the node once (cached across restarts)."""
    if not source.startswith("s3://"):
        return source
    try:
        return node_local_copy(source, local_rank, barrier)
    except OSError as error:
        raise ModelError(f"cannot download {source}: {error}") from error


def load_tokenizer(
    spec: ModelSpec, local_rank: int, barrier: Callable[[], None]
) -> PreTrainedTokenizerBase | None:
    source = spec.tokenizer or spec.source
    if source is None:
        return None
    if source == BYTE_LEVEL:
        return byte_level_tokenizer()
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            resolve(source, local_rank, barrier), revision=spec.revision
        )
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load tokenizer {source}: {error}") from error
    return tokenizer


def model_config(spec: ModelSpec, local_rank: int, barrier: Callable[[], None]) -> PretrainedConfig:
    if spec.from_config is not None:
        settings = dict(spec.from_config)
        model_type = settings.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ConfigError("model.fromConfig needs a model_type, e.g. qwen2")
        try:
            config: PretrainedConfig = AutoConfig.for_model(model_type, **settings)
        except (ValueError, TypeError) as error:
            raise ConfigError(f"model.fromConfig is not a valid {model_type} config: {error}") from error
        return config
    if spec.source is None:
        raise ConfigError("set model.source or model.fromConfig")
    try:
        loaded: PretrainedConfig = AutoConfig.from_pretrained(
            resolve(spec.source, local_rank, barrier), revision=spec.revision
        )
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load the config of {spec.source}: {error}") from error
    return loaded


def load_model(
    spec: ModelSpec, config: PretrainedConfig, seed: int, local_rank: int, barrier: Callable[[], None]
) -> PreTrainedModel:
    """The full model in fp32 on CPU on every rank (FSDP keeps fp32 master weights and casts for compute);
    fully_shard then moves each rank's shard to its device."""
    torch.manual_seed(seed)  # identical random initialisation on every rank
    try:
        if spec.from_config is not None or spec.source is None:
            model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                resolve(spec.source, local_rank, barrier), revision=spec.revision, dtype=torch.float32
            )
    except (OSError, ValueError, KeyError) as error:
        raise ModelError(f"cannot build the model: {error}") from error
    model.config.use_cache = False
    return model


def model_shape(model: PreTrainedModel) -> ModelShape:
    """Parameter count for the FLOPs estimate: a tied embedding counts once (as the output projection);
    an untied input embedding is a lookup and does no matmul work."""
    params = sum(p.numel() for p in model.parameters())
    lm: Any = model
    embedding: torch.Tensor = lm.get_input_embeddings().weight
    if embedding is not lm.get_output_embeddings().weight:
        params -= embedding.numel()
    config: Any = model.config
    return ModelShape(params=params, layers=config.num_hidden_layers, hidden=config.hidden_size)
