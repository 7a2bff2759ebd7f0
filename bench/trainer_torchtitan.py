"""Baseline B of the GPU benchmark: torchtitan's own trainer (PyPI torchtitan 0.3.0) with the model shape and
settings of bench/gpu_fsdp.py, which launches it as

    BASELINE_B_SETTINGS='<json>' PYTHONPATH=bench torchrun --standalone --nproc-per-node 1 \\
        -m torchtitan.train --module trainer_torchtitan --config baseline_b

torchtitan 0.3 configures runs with Python functions (a module's "config registry"), not TOML: `baseline_b`
below is one, reading the settings gpu_fsdp.py passes in BASELINE_B_SETTINGS (see `Settings`).

What is the same as our loop: the sizes of the model (layers, hidden, heads, KV heads, FFN, vocabulary, tied
embeddings, RoPE theta), sequence length, micro-batch, one micro-batch per step, FSDP2 with bf16 compute
and fp32 gradient reduction, fp32 master weights, AdamW (betas 0.9/0.95, no weight decay), clipping at 1.0,
no activation checkpointing, no checkpoints, per-block torch.compile or none, uniform random tokens with one
document per row, and no CUDA graphs: torchtitan 0.3 captures its forward and backward in a CUDA graph by
default (training.disable_cuda_graphs), which neither our loop nor baseline A does, so they are off here
(Settings.cuda_graphs) and the comparison is eager against eager, compiled against compiled. What is
torchtitan's: the model code. It has no Qwen2, so its Qwen3 stands in: the same matmuls, but Qwen3
normalises queries and keys per head and has no q/k/v biases. Its FlexAttention (block causal, here plain
causal) instead of SDPA, its loss, and its other defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.qwen3 import (  # the private ones: torchtitan 0.3's own flavors are built with them
    _EMBEDDING_SKIP_INIT,
    _LINEAR_INIT,
    Qwen3Model,
    _build_qwen3_layers,
    _qwen3_norm,
    model_registry,
)
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

SETTINGS_ENV = "BASELINE_B_SETTINGS"


@dataclass(frozen=True)
class Settings:
    shape: dict[str, Any]  # a Hugging Face Qwen2 config.json's sizes
    sequence_length: int
    micro_batch_size: int
    steps: int
    compile: bool
    dump_folder: str
    cuda_graphs: bool = False  # torchtitan captures forward+backward in a CUDA graph unless told not to
    learning_rate: float = 1e-4
    seed: int = 0


class SyntheticTokens(BaseDataLoader):
    """Uniform random token ids, each row one document: the data of our loop's synthetic source."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 0
        seed: int = 0

    def __init__(
        self, config: Config, *, dp_rank: int, seq_len: int, local_batch_size: int, **_: Any
    ) -> None:
        self.config, self.seq_len, self.batch = config, seq_len, local_batch_size
        self.generator = torch.Generator().manual_seed(config.seed * 100_003 + dp_rank)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        positions = torch.arange(self.seq_len).expand(self.batch, self.seq_len)
        while True:
            tokens = torch.randint(
                0, self.config.vocab_size, (self.batch, self.seq_len + 1), generator=self.generator
            )
            yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class NoTokenizer(BaseTokenizer):
    """torchtitan builds a tokenizer for every run; synthetic tokens need none, and none is on disk."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 0

    def __init__(self, config: Config, **_: Any) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("synthetic tokens are never encoded")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("synthetic tokens are never decoded")

    def get_vocab_size(self) -> int:
        return self.vocab_size


def qwen3_of_shape(shape: dict[str, Any], sequence_length: int) -> ModelSpec:
    """torchtitan's Qwen3 (its parallelisation, FlexAttention) with the sizes of a Qwen2 config."""
    vocab, dim, layers = shape["vocab_size"], shape["hidden_size"], shape["num_hidden_layers"]
    heads = shape["num_attention_heads"]
    head_dim = dim // heads
    model = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=shape["tie_word_embeddings"],
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=_EMBEDDING_SKIP_INIT if shape["tie_word_embeddings"] else _LINEAR_INIT,
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            fuse_qkv=True,
            n_layers=layers,
            dim=dim,
            n_heads=heads,
            n_kv_heads=shape["num_key_value_heads"],
            head_dim=head_dim,
            hidden_dim=shape["intermediate_size"],
            attn_backend="flex",
            rope=CosSinRoPE.Config(
                dim=head_dim, max_seq_len=sequence_length, theta=shape.get("rope_theta", 1e6)
            ),
        ),
    )
    return dataclasses.replace(model_registry("0.6B"), flavor=f"{layers}x{dim}", model=model)


def baseline_b() -> Trainer.Config:
    settings = Settings(**json.loads(os.environ[SETTINGS_ENV]))
    vocab = settings.shape["vocab_size"]
    return Trainer.Config(
        model_spec=qwen3_of_shape(settings.shape, settings.sequence_length),
        dump_folder=settings.dump_folder,
        tokenizer=NoTokenizer.Config(vocab_size=vocab),
        dataloader=SyntheticTokens.Config(vocab_size=vocab, seed=settings.seed),
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        optimizer=default_adamw(lr=settings.learning_rate, weight_decay=0.0),
        training=TrainingConfig(
            local_batch_size=settings.micro_batch_size,
            seq_len=settings.sequence_length,
            steps=settings.steps,
            max_norm=1.0,
            disable_cuda_graphs=not settings.cuda_graphs,
        ),
        activation_checkpoint=None,
        compile=CompileConfig(enable=settings.compile, components=["model"]),
    )
