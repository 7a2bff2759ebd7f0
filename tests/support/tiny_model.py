"""A tiny Qwen2 causal LM built in this process (the DLC venv): the manifests' tiny configuration, seeded, so
that every trainer test and bench that needs a model starts from the same one."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.support.manifests import tiny_qwen2


def tiny_lm(seed: int = 0, **settings: Any) -> torch.nn.Module:
    """`settings` override the tiny configuration's sizes and any other Qwen2 config field."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_qwen2(**settings)))
