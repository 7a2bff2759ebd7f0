"""Manifests for tests: the examples with changes, and a model small enough to train on a CPU."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from tests.support.paths import REPO

DELETE = object()  # as a value in `with_changes`: remove the field

# ChatML (Qwen's turn markup), for tokenizers without a chat template of their own: data.chatTemplate.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_changes(spec: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of `spec` with dotted-path changes ({"cluster.workers": 3}) applied."""
    changed = copy.deepcopy(spec)
    for dotted, value in changes.items():
        target = changed
        *parents, leaf = dotted.split(".")
        for key in parents:
            target = target.setdefault(key, {})
        if value is DELETE:
            target.pop(leaf)
        else:
            target[leaf] = value
    return changed


def example(name: str, **spec_changes: Any) -> dict[str, Any]:
    """A manifest from examples/, with changes to its spec."""
    manifest: dict[str, Any] = yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())
    manifest["spec"] = with_changes(manifest["spec"], spec_changes)
    return manifest


def tiny_qwen2(**sizes: Any) -> dict[str, Any]:
    """A Qwen2 config (model.fromConfig) small enough to train in seconds on a CPU; `sizes` override."""
    return {
        "model_type": "qwen2",
        "vocab_size": 320,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
        **sizes,
    }
