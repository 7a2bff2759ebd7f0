"""Tokenizer and causal LM loading: hub id, local directory, s3:// prefix (downloaded once per node), or a
random initialisation from a config dict, plus the built-in byte-level tokenizer."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from fsdp_trainer import adapter
from fsdp_trainer.contract import ModelSpec
from fsdp_trainer.errors import ConfigError, ModelError
from fsdp_trainer.metrics import ModelShape
from fsdp_trainer.storage import node_local_copy

log = logging.getLogger(__name__)

if int(transformers.__version__.split(".")[0]) < 5:
    # Before 5, nothing refills a rotary embedding's inv_freq after `to_empty` (transformers 5's
    # _init_weights does, see `materialise`): RoPE would read uninitialised memory without an error.
    raise ImportError(f"fsdp_trainer needs transformers>=5, not {transformers.__version__}")

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


# What a materialised model is filled with: see `materialise`.
Weights = Literal["initialise", "load", "checkpoint"]


def empty_model(config: PretrainedConfig) -> PreTrainedModel:
    """The architecture on the meta device: no memory, no initialisation. It is sharded first and then
    materialised (`materialise`), so no rank ever holds more than its shard of the fp32 weights."""
    try:
        with torch.device("meta"):
            model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError) as error:
        raise ModelError(f"cannot build the model: {error}") from error
    model.config.use_cache = False
    return model


def materialise(
    model: PreTrainedModel,
    device: torch.device,
    weights: Weights,
    spec: ModelSpec,
    seed: int,
    shard_index: int,
    local_rank: int,
    barrier: Callable[[], None],
    cpu_offload: bool = False,
) -> None:
    """Gives the sharded meta model real storage on `device` (parameters on the CPU with cpu_offload, as
    FSDP's offload policy expects) and fills it: a random initialisation ("initialise"), the pretrained
    weights read straight into each rank's shards ("load"), or nothing but the buffers that no checkpoint
    holds, such as rotary frequencies ("checkpoint": the checkpoint's weights are loaded next). Buffers are
    refilled by transformers' `_init_weights`, whose rotary branch (transformers>=5) recomputes inv_freq and
    original_inv_freq from the config. `shard_index` is this rank's coordinate along the mesh's shard
    dimension: the replicas of one shard (HYBRID_SHARD, NO_SHARD) have the same and so draw the same
    weights."""
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    for module in model.modules():  # buffers are not sharded or offloaded: forward reads them on the device
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)
    lm: Any = model
    with torch.no_grad():
        if weights == "initialise":
            _forget_initialisation(model)
            with seeded_for_shards(device, cpu_offload, seed, shard_index):
                lm.initialize_weights()
        else:
            for module in model.modules():
                if any(True for _ in module.buffers(recurse=False)):
                    lm._init_weights(module)
        if weights == "load":
            if spec.source is None:
                raise ConfigError("model.source is needed to load weights")
            _load_pretrained_shards(model, weights_directory(spec, local_rank, barrier))


@contextlib.contextmanager
def seeded_for_shards(device: torch.device, cpu_offload: bool, seed: int, shard_index: int) -> Iterator[None]:
    """Random initialisation of sharded parameters from `seed`. DTensor's random ops keep shards consistent
    only for parameters on CUDA (offsets by shard coordinate, so replicas agree); elsewhere each shard draws
    from its own stream, which must differ between shards (or shards would repeat) and be the same for the
    replicas of one shard (or they would start apart, and nothing broadcasts them)."""
    consistent = device.type == "cuda" and not cpu_offload
    torch.manual_seed(seed if consistent else seed * 100_003 + shard_index)
    with warnings.catch_warnings():
        # DTensor warns on every random op off CUDA; the per-shard seed above is the answer to it.
        warnings.filterwarnings("ignore", "DTensor random operators may not have complete support")
        yield


def _forget_initialisation(model: torch.nn.Module) -> None:
    """transformers skips modules and tensors it marked as initialised; on meta nothing really was."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            tensor.__dict__.pop("_is_hf_initialized", None)


def weights_directory(spec: ModelSpec, local_rank: int, barrier: Callable[[], None]) -> str:
    """A local directory holding the model's safetensors: an s3:// prefix copied to the node once, a hub
    id from the hub's cache (downloaded by local rank 0), or the local path itself."""
    source = spec.source or ""
    if source.startswith("s3://") or os.path.isdir(source):
        return resolve(source, local_rank, barrier)
    from huggingface_hub import snapshot_download

    def download() -> str:
        return str(
            snapshot_download(source, revision=spec.revision, allow_patterns=["*.safetensors", "*.json"])
        )

    try:
        if local_rank == 0:
            download()
        barrier()
        return download()  # from the node's cache now
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot download the weights of {source}: {error}") from error


def _load_pretrained_shards(model: PreTrainedModel, directory: str) -> None:
    """Each rank reads only its shards from the safetensors files (DCP's Hugging Face reader), converting
    to the model's fp32. A tied output head is the input embedding and is not in the files."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import load

    lm: Any = model
    # An adapter's weights are not in the files, and the weights it wraps are there under their plain names.
    state = {
        adapter.pretrained_name(name): tensor
        for name, tensor in model.state_dict().items()
        if not adapter.is_adapter_weight(name)
    }
    if lm.get_output_embeddings() is not None and (
        lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    ):
        state = {name: tensor for name, tensor in state.items() if not name.startswith("lm_head.")}
    try:
        load(state, storage_reader=HuggingFaceStorageReader(directory))
    except (OSError, ValueError, RuntimeError) as error:
        raise ModelError(f"cannot load the weights in {directory}: {error}") from error


# Attention implementations that mask causally by themselves when given no mask (SDPA's is_causal, flash
# attention's causal flag); eager and flex attention need the mask built.
_CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


def prepared_attention_masks(config: PretrainedConfig | None) -> dict[str, None] | None:
    """The decoder's attention masks ready-made (transformers skips building them), where causal attention
    needs none: every layer on full attention (no sliding window) through SDPA or flash attention, over rows
    without left padding (packed rows; right padding only follows the tokens that matter). Built each
    forward, they cost a host sync per micro-batch: transformers checks on the host whether the positions
    of a row restart (packed documents), and the GPU's queue drains before the next kernel is queued. None
    where the masks must be built (or for a model without a transformers config)."""
    implementation = getattr(config, "_attn_implementation", None)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if implementation not in _CAUSAL_WITHOUT_MASK or layer_types != {"full_attention"}:
        return None
    return {"full_attention": None}


def model_shape(model: PreTrainedModel) -> ModelShape:
    """Parameter count for the FLOPs estimate: a tied embedding counts once (as the output projection);
    an untied input embedding is a lookup and does no matmul work."""
    params = sum(p.numel() for p in model.parameters())
    lm: Any = model
    embedding: torch.Tensor = lm.get_input_embeddings().weight
    if embedding is not lm.get_output_embeddings().weight:
        params -= embedding.numel()
    config: Any = model.config
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(params=params, layers=config.num_hidden_layers, heads=heads, head_dim=int(head_dim))
