"""Learning-rate schedule: linear warmup to the peak, then cosine or linear decay to the floor."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fsdp_trainer.contract import Schedule, TrainingSpec
from fsdp_trainer.optim import build_optimizer, build_scheduler, clip_gradients, lr_factor


def spec(**fields: object) -> TrainingSpec:
    return TrainingSpec.model_validate(
        {"max_steps": 10, "warmup_steps": 2, "min_learning_rate_ratio": 0.1, **fields}
    )


def test_warmup_rises_linearly_to_the_peak() -> None:
    training = spec(warmup_steps=4)
    assert [lr_factor(s, training) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("schedule", [Schedule.COSINE, Schedule.LINEAR])
def test_decay_starts_at_the_peak_and_ends_at_the_floor_on_the_last_step(schedule: Schedule) -> None:
    training = spec(schedule=schedule)
    factors = [lr_factor(s, training) for s in range(training.max_steps)]
    assert factors[2] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[2:])), factors


def test_cosine_is_half_way_at_the_middle_of_the_decay() -> None:
    training = spec(max_steps=11, warmup_steps=0, min_learning_rate_ratio=0.0)
    assert lr_factor(5, training) == pytest.approx(0.5)
    assert lr_factor(2, training) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))


def test_constant_stays_at_the_peak_after_warmup() -> None:
    training = spec(schedule=Schedule.CONSTANT)
    assert [lr_factor(s, training) for s in range(2, 10)] == [1.0] * 8


def test_scheduler_drives_the_optimizer_and_round_trips_its_state() -> None:
    training = spec(learning_rate=1e-3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, training)
    scheduler = build_scheduler(optimizer, training)
    seen = []
    for _ in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1e-3 * lr_factor(s, training) for s in range(5)])
    restored = build_scheduler(optimizer, training)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.last_epoch == 5 and restored.get_last_lr() == scheduler.get_last_lr()


def test_weight_decay_applies_to_matrices_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decayed, plain = build_optimizer(model, spec(weight_decay=0.1)).param_groups
    assert decayed["weight_decay"] == 0.1 and [p.ndim for p in decayed["params"]] == [2]
    assert plain["weight_decay"] == 0.0 and all(p.ndim == 1 for p in plain["params"])


def test_without_clipping_an_overflowed_gradient_is_reported_not_turned_into_nan() -> None:
    finite, overflowed = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    finite.grad, overflowed.grad = torch.full((3,), 2.0), torch.tensor([math.inf, 1.0])
    norm = clip_gradients([finite, overflowed], max_norm=0)
    assert math.isinf(float(norm))
    assert torch.equal(finite.grad, torch.full((3,), 2.0)), "clipping disabled leaves gradients as they are"


def test_clipping_scales_gradients_to_the_maximum_norm() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])
    assert float(clip_gradients([weight], max_norm=1.0)) == pytest.approx(5.0)
    assert float(torch.linalg.vector_norm(weight.grad)) == pytest.approx(1.0, rel=1e-5)
