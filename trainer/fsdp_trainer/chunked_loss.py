"""Chunked cross-entropy for large vocabularies (training.lossChunkTokens).

The usual causal-LM loss materialises the logits of every token at once: micro-batch 4 x 2048 tokens x
Qwen2.5's 151,936-token vocabulary is 5 GB in fp32, plus as much again for their gradient. Here the output
projection and the cross-entropy run a chunk of tokens at a time under activation checkpointing, so only
one chunk's logits exist at any moment; backward recomputes them (one more output-projection matmul).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast

from fsdp_trainer.errors import ConfigError

IGNORE_INDEX = -100  # transformers' label for "no target here"
# Output transforms the chunked path would skip: refused rather than silently computing another loss.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    chunk_tokens: int,
    num_items_in_batch: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' causal-LM loss (each position predicts the next label; summed over positions with a
    label and divided by `num_items_in_batch`, or by their number here), computed `chunk_tokens` positions
    at a time in fp32."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])

    def chunk_loss_sum(chunk: torch.Tensor, chunk_targets: torch.Tensor) -> torch.Tensor:
        logits = head(chunk).float()
        return F.cross_entropy(logits, chunk_targets, ignore_index=IGNORE_INDEX, reduction="sum")

    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(chunk_loss_sum, flat[start:end], targets[start:end], use_reentrant=False)
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum()
    return total / num_items_in_batch.to(total.device)


def install(model: torch.nn.Module, chunk_tokens: int) -> None:
    """Makes `model(input_ids=..., labels=...)` return the chunked loss (and no logits). Only `forward` is
    replaced: the call still runs the module hooks, so a sharded root gathers and reduces its parameters (the
    embeddings and output projection) as it does for the unchunked loss."""
    lm: Any = model  # a transformers causal LM, its class replaced by FSDP's
    config = lm.config
    transforms = [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1.0)]
    if transforms:
        raise ConfigError(
            f"training.lossChunkTokens cannot be used with {config.model_type}: its logits go through "
            f"{', '.join(transforms)}, which the chunked loss does not apply"
        )
    decoder = lm.base_model  # the transformer up to its final norm, without the output projection
    head = lm.get_output_embeddings()

    def forward(
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        num_items_in_batch: torch.Tensor | None = None,
        attention_mask: Any = None,
        position_ids: torch.Tensor | None = None,
    ) -> CausalLMOutputWithPast:
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        loss = chunked_cross_entropy(hidden, head, labels, chunk_tokens, num_items_in_batch)
        # transformers' output type, which FSDP's hooks can look into for the tensors backward starts from
        return CausalLMOutputWithPast(loss=cast(torch.FloatTensor, loss))

    lm.forward = forward
