"""Throughput arithmetic: FLOPs per token, model FLOPs utilisation, and the per-device peak table."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' spec sheets, FLOP/s. MFU uses the spec value
# by convention, so it stays comparable across reports; measured matmul peaks are lower (an H200 here
# reached about 790e12 in a bf16 matmul loop, 80 % of spec). Keys are matched as whole words of the CUDA
# device name, longest first, so "H100 PCIe" wins over "H100" and "L4" never matches an "L40".
PEAK_BF16_FLOPS: dict[str, float] = {
    "B200": 2250e12,
    "H200 NVL": 835e12,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 125e12,  # AWS publishes no figure; this is NVIDIA's A10 spec, the same GA102 part
    "A10": 125e12,
    "V100": 125e12,  # fp16 (V100 has no bf16)
    "T4": 65e12,  # fp16
}


def peak_flops(device_name: str) -> float | None:
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name):
            return PEAK_BF16_FLOPS[key]
    return None


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs estimate needs from a decoder-only transformer."""

    params: int  # parameters that do matmul work per token (input embeddings excluded unless tied)
    layers: int
    heads: int  # query heads
    head_dim: int


def flops_per_token(shape: ModelShape, sequence_length: int) -> float:
    """Training FLOPs per token: 6N for the parameter matmuls (forward 2N, backward 4N) plus the attention
    scores and weighted sum, 12 * layers * heads * head_dim * sequence_length: torchtitan's count
    (models/utils.py, get_dense_model_nparams_and_flops), PaLM's appendix B with the attention width
    heads * head_dim, which is not the hidden size in every model (Qwen3 0.6B: 16 x 128 = 2048 against
    1024)."""
    return 6 * shape.params + 12 * shape.layers * shape.heads * shape.head_dim * sequence_length


def model_flops_utilisation(
    tokens_per_second_per_device: float, flops_per_token: float, peak: float | None
) -> float | None:
    if peak is None or peak <= 0:
        return None
    return tokens_per_second_per_device * flops_per_token / peak
