"""Goodput accounting: the categories add up to the run's wall time, restarts and checkpoints move time out of
training, and a pass that changes nothing else writes nothing until the figures are a minute old."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from fsdp_operator import api, goodput
from fsdp_trainer.contract import CheckpointRef, ProgressRecord

CREATED = dt.datetime(2026, 12, 4, 9, 0, tzinfo=dt.UTC)
PRICE = 4.6016  # USD per g6.12xlarge-hour, on demand in us-west-2
SPEC = api.FSDPTrainingRunSpec.model_validate(
    {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}, "training": {"maxSteps": 50}}
)


def at(seconds: int) -> dt.datetime:
    return CREATED + dt.timedelta(seconds=seconds)


def status(phase: api.Phase, **fields: Any) -> api.FSDPTrainingRunStatus:
    return api.FSDPTrainingRunStatus(phase=phase, **fields)


def progress(step: int | None, updated: int, stage: str | None = None) -> api.ProgressStatus:
    return api.ProgressStatus(step=step, max_steps=50, stage=stage, updated_at=at(updated))


def record(step: int, updated: int, **fields: Any) -> ProgressRecord:
    return ProgressRecord(
        run_name="r", phase="training", step=step, max_steps=50, updated_at=at(updated), **fields
    )


def checkpoints(step: int) -> api.CheckpointsStatus:
    return api.CheckpointsStatus(
        latest=CheckpointRef(step=step, uri=f"s3://b/p/checkpoint_{step}", time=CREATED)
    )


def test_a_run_with_a_restart_adds_up_to_its_wall_time_to_the_second() -> None:
    attempt_2 = {"attempt": 2, "attempt_time": at(290)}
    timeline: list[tuple[int, api.FSDPTrainingRunStatus, ProgressRecord | None]] = [
        (0, status(api.Phase.PENDING), None),
        (30, status(api.Phase.PROVISIONING), None),
        (90, status(api.Phase.CLUSTER_READY, attempt=1, attempt_time=at(90)), None),
        (
            100,
            status(
                api.Phase.RUNNING,
                attempt=1,
                attempt_time=at(90),
                progress=progress(None, 100, "loading-model"),
            ),
            None,
        ),
        (
            130,
            status(api.Phase.RUNNING, attempt=1, attempt_time=at(90), progress=progress(10, 130)),
            record(10, 130),
        ),
        (
            200,
            status(
                api.Phase.RUNNING,
                attempt=1,
                attempt_time=at(90),
                progress=progress(20, 200),
                checkpoints=checkpoints(20),
            ),
            record(20, 200, step_time_seconds=6.0, checkpoint_blocked_seconds=3.2),
        ),
        (
            250,
            status(
                api.Phase.RUNNING,
                attempt=1,
                attempt_time=at(90),
                progress=progress(30, 250),
                checkpoints=checkpoints(20),
            ),
            record(30, 250, step_time_seconds=6.0, tokens_seen=30_000),
        ),
        (
            260,
            status(
                api.Phase.RESTARTING,
                attempt=1,
                attempt_time=at(90),
                progress=progress(30, 250),
                checkpoints=checkpoints(20),
            ),
            record(30, 250, step_time_seconds=6.0, tokens_seen=30_000),
        ),
        (
            290,
            status(
                api.Phase.RUNNING,
                **attempt_2,
                progress=progress(None, 291, "loading-checkpoint"),
                checkpoints=checkpoints(20),
            ),
            None,
        ),
        (
            320,
            status(api.Phase.RUNNING, **attempt_2, progress=progress(21, 320), checkpoints=checkpoints(20)),
            record(21, 320, step_time_seconds=6.0, tokens_seen=21_000),
        ),
        (
            600,
            status(
                api.Phase.SUCCEEDED,
                **attempt_2,
                progress=progress(50, 600),
                checkpoints=checkpoints(20),
                completion_time=at(600),
            ),
            record(50, 600, step_time_seconds=6.0, tokens_seen=50_000),
        ),
    ]
    old = timeline[0][1]
    for seconds, new, trainer in timeline[1:]:
        new.goodput = goodput.account(SPEC, old, new, trainer, at(seconds), CREATED, PRICE)
        old = new
    result = old.goodput
    spent = result.seconds
    assert (spent.queued, spent.provisioning, spent.idle) == (30, 60 + 10 + 30 + 30, 0)
    # 70 s to step 20 less the checkpoint's 3 s; 50 + 10 s to step 30 less the 10 steps the restart redoes;
    # 280 s from step 21 to the end.
    assert (spent.training, spent.checkpoint_stall) == (67 + 280, 3)
    assert spent.lost_to_restarts == 60 + 30  # the redone steps, then the 30 s the restart took
    total = spent.queued + spent.provisioning + spent.training + spent.checkpoint_stall
    assert total + spent.lost_to_restarts + spent.idle == 600
    assert result.accounted_until == at(600)
    held = 600 - 30  # from the cluster's creation to the end
    assert result.fraction == round(347 / held, 4)
    workers, gpus = SPEC.cluster.workers, SPEC.cluster.gpus()
    assert result.gpu_seconds_held == held * workers * gpus and result.worker_seconds_held == held * workers
    assert result.cost_usd == pytest.approx(held * workers / 3600 * PRICE, abs=1e-4)
    assert result.tokens == 50_000
    assert result.cost_per_million_tokens_usd == pytest.approx(
        held * workers / 3600 * PRICE / 50_000 * 1e6, abs=1e-3
    )
    assert result.eta is None and result.progress_percent == 100.0

    later = status(api.Phase.SUCCEEDED, goodput=result, completion_time=at(600))
    assert goodput.account(SPEC, later, later, None, at(900), CREATED, PRICE) == result, "finished: no more"


def test_a_pass_that_changes_nothing_else_leaves_goodput_until_it_is_a_minute_old() -> None:
    waiting = status(api.Phase.PENDING)
    waiting.goodput = goodput.account(
        SPEC, waiting, status(api.Phase.PENDING, message="x"), None, at(10), CREATED, None
    )
    assert waiting.goodput.seconds.queued == 10 and waiting.goodput.cost_usd is None
    same = waiting.model_copy(deep=True)
    assert goodput.account(SPEC, waiting, same, None, at(69), CREATED, None) == waiting.goodput
    refreshed = goodput.account(SPEC, waiting, same, None, at(70), CREATED, None)
    assert refreshed.seconds.queued == 70 and refreshed.accounted_until == at(70)


@pytest.mark.parametrize(
    ("phase", "shown", "expected"),
    [
        (api.Phase.PENDING, None, "queued"),
        (api.Phase.QUEUED, None, "queued"),
        (api.Phase.PROVISIONING, None, "provisioning"),
        (api.Phase.RUNNING, progress(None, 100, "loading-model"), "provisioning"),
        (api.Phase.RUNNING, progress(5, 80), "provisioning"),  # the previous attempt's step
        (api.Phase.RUNNING, progress(5, 120), "training"),
        (api.Phase.RESTARTING, progress(5, 120), "lost_to_restarts"),
        (api.Phase.SUSPENDED, None, "idle"),
        (api.Phase.FAILED, None, None),
    ],
)
def test_each_state_charges_its_category(
    phase: api.Phase, shown: api.ProgressStatus | None, expected: str | None
) -> None:
    run = status(phase, attempt_time=at(100), progress=shown or api.ProgressStatus())
    assert goodput.category(run) == expected


def test_a_running_run_has_an_eta_from_its_step_time() -> None:
    old = status(api.Phase.RUNNING, attempt_time=at(0), progress=progress(10, 100))
    new = status(api.Phase.RUNNING, attempt_time=at(0), progress=progress(20, 160))
    result = goodput.account(SPEC, old, new, record(20, 160, step_time_seconds=3.0), at(160), CREATED, None)
    assert result.progress_percent == 40.0 and result.eta == at(160 + 30 * 3)


def test_each_attempts_fabric_check_leaves_provisioning_for_its_own_category() -> None:
    from fsdp_trainer.contract import FabricReport

    def checked(attempt: int, seconds: float) -> api.FabricStatus:
        return api.FabricStatus(
            attempt=attempt, report=FabricReport(backend="gloo", transport="gloo", seconds=seconds)
        )

    setting_up = status(api.Phase.RUNNING, attempt=1, attempt_time=at(0), progress=progress(None, 50, "x"))
    first = setting_up.model_copy(update={"fabric": checked(1, 4.4)})
    first.goodput = goodput.account(SPEC, setting_up, first, None, at(60), CREATED, None)
    assert (first.goodput.seconds.provisioning, first.goodput.seconds.fabric_check) == (56, 4)
    again = first.model_copy(update={"message": "still setting up"})
    again.goodput = goodput.account(SPEC, first, again, None, at(70), CREATED, None)
    assert again.goodput.seconds.fabric_check == 4, "one check is counted once"
    second = again.model_copy(update={"attempt": 2, "fabric": checked(2, 2.6)})
    second.goodput = goodput.account(SPEC, again, second, None, at(80), CREATED, None)
    spent = second.goodput.seconds
    assert spent.fabric_check == 7 and spent.provisioning + spent.fabric_check == 80


def test_spot_and_on_demand_hours_are_each_charged_at_their_own_price() -> None:
    prices = {"g6.12xlarge:spot": 1.5, "g6.12xlarge:on-demand": 4.6016, "p5.48xlarge": 98.32}
    assert goodput.hour_price(prices, "g6.12xlarge", ["spot", "spot"]) == 1.5
    assert goodput.hour_price(prices, "g6.12xlarge", ["spot", "on-demand"]) == pytest.approx(
        (1.5 + 4.6016) / 2
    )
    assert goodput.hour_price(prices, "g6.12xlarge", []) == 4.6016  # none placed yet: on-demand
    assert goodput.hour_price(prices, "p5.48xlarge", ["spot"]) == 98.32  # not priced apart: the type's
    assert goodput.hour_price(prices, "g5.48xlarge", ["spot"]) is None
    assert goodput.capacity_type({"karpenter.sh/capacity-type": "spot"}) == "spot"
    assert goodput.capacity_type({"eks.amazonaws.com/capacityType": "SPOT"}) == "spot"
    assert goodput.capacity_type({"eks.amazonaws.com/capacityType": "ON_DEMAND"}) == "on-demand"
    # An hour on spot, then an hour on demand after the spot node was reclaimed: each at its price.
    first = status(api.Phase.RUNNING, attempt=1, progress=progress(1, 10))
    spot_hour = first.model_copy(update={"message": "on spot"})
    spot_hour.goodput = goodput.account(SPEC, first, spot_hour, None, at(3600), CREATED, 1.5)
    demand_hour = spot_hour.model_copy(update={"message": "on demand"})
    demand_hour.goodput = goodput.account(SPEC, spot_hour, demand_hour, None, at(7200), CREATED, 4.6016)
    workers = SPEC.cluster.workers
    assert demand_hour.goodput.cost_usd == pytest.approx(workers * (1.5 + 4.6016), abs=1e-4)
