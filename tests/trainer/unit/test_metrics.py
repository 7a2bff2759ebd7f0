"""FLOPs per token (with the attention term), MFU, and the per-device peak table."""

from __future__ import annotations

import pytest

from fsdp_trainer.metrics import ModelShape, flops_per_token, model_flops_utilisation, peak_flops

QWEN25_15B = ModelShape(params=1_543_714_304, layers=28, heads=12, head_dim=128)


def test_qwen25_15b_at_2048_tokens_costs_about_10_3_gflops_per_token() -> None:
    flops = flops_per_token(QWEN25_15B, 2048)
    assert flops == 6 * 1_543_714_304 + 12 * 28 * 1536 * 2048
    assert flops == pytest.approx(10.32e9, rel=1e-3)


def test_attention_term_grows_with_sequence_length() -> None:
    assert flops_per_token(QWEN25_15B, 4096) - flops_per_token(QWEN25_15B, 2048) == 12 * 28 * 1536 * 2048


@pytest.mark.parametrize(
    ("device", "peak"),
    [
        ("NVIDIA L4", 121e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L40", 181e12),  # not the L4's figure
        ("NVIDIA H200 NVL", 835e12),  # not the SXM part's
    ],
)
def test_peak_flops_by_device_name(device: str, peak: float) -> None:
    assert peak_flops(device) == peak


def test_unknown_device_has_no_peak_and_no_mfu() -> None:
    assert peak_flops("Some Future Accelerator") is None
    assert model_flops_utilisation(1000.0, 1e9, None) is None


def test_mfu_is_achieved_over_peak_flops() -> None:
    # 4 x L4 at 2,000 tokens/s/device on Qwen2.5-1.5B: 2000 * 10.32e9 / 121e12 ~ 17 %.
    mfu = model_flops_utilisation(2000.0, flops_per_token(QWEN25_15B, 2048), peak_flops("NVIDIA L4"))
    assert mfu == pytest.approx(2000 * 10.3213e9 / 121e12, rel=1e-3)
