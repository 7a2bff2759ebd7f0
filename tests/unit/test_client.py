"""The Python client's pure parts: specs validated by the CRD's own models before anything reaches a cluster,
the metric history as rows and as a DataFrame, errors of one line, and pandas imported only when asked for."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import textwrap

import pytest
from botocore.exceptions import ClientError as BotoClientError
from botocore.exceptions import NoCredentialsError

from fsdp_client import FSDPTrainingRunSpec, InvalidSpec, RunFailed, TrainingRun, metrics
from fsdp_client.client import validate_name, validated_spec
from fsdp_client.storage import not_readable
from fsdp_trainer.contract import ProgressRecord
from tests.support.paths import REPO

NOW = dt.datetime(2026, 12, 6, 8, 0, tzinfo=dt.UTC)
REQUIRED = {"model": {"source": "Qwen/Qwen3-0.6B"}, "checkpoint": {"storagePath": "s3://bucket/runs"}}


def test_a_spec_from_keywords_is_sent_as_given_in_the_manifests_spelling() -> None:
    sent = validated_spec(None, {**REQUIRED, "training": {"max_steps": 40, "learningRate": 3e-4}})
    # snake_case or camelCase in, camelCase out; defaults left to the cluster, as `kubectl apply` leaves them.
    assert sent == {**REQUIRED, "training": {"maxSteps": 40, "learningRate": 3e-4}}


def test_a_spec_model_takes_keyword_overrides() -> None:
    spec = FSDPTrainingRunSpec.model_validate({**REQUIRED, "training": {"maxSteps": 40}})
    sent = validated_spec(spec, {"training": {"maxSteps": 80}, "suspend": True})
    assert sent["training"] == {"maxSteps": 80} and sent["suspend"] is True
    assert sent["model"] == REQUIRED["model"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"training": {"maxSteps": 0}}, "spec.training.maxSteps: Input should be greater than or equal to 1"),
        ({"cluster": {"workers": "two"}}, "spec.cluster.workers: Input should be a valid integer"),
        ({"trainig": {"maxSteps": 10}}, "spec.trainig: Extra inputs are not permitted"),
        ({"checkpoint": None}, "spec.checkpoint: Input should be a valid dictionary"),
    ],
)
def test_an_invalid_spec_is_refused_in_one_line_naming_the_field(
    fields: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidSpec) as refused:
        validated_spec(None, {**REQUIRED, **fields})
    message = str(refused.value)
    assert named in message and "\n" not in message, message
    assert refused.value._render_traceback_() == [f"InvalidSpec: {message}"]  # what IPython shows


def test_a_missing_required_field_is_named() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.checkpoint: Field required"):
        validated_spec(None, {"model": {"source": "Qwen/Qwen3-0.6B"}})


@pytest.mark.parametrize("name", ["Upper", "-lead", "x" * 64, "under_score"])
def test_a_name_that_cannot_be_a_label_value_is_refused(name: str) -> None:
    with pytest.raises(InvalidSpec, match=r"metadata\.name"):
        validate_name(name)


def record(step: int, submission: str | None, phase: str = "training", **fields: object) -> ProgressRecord:
    return ProgressRecord.model_validate(
        {"run_name": "r", "phase": phase, "step": step, "max_steps": 20, "submission_id": submission,
         "updated_at": NOW, "loss": 5.0 - step / 10, "world_size": 2, **fields}
    )  # fmt: skip


def test_the_metric_history_has_one_row_per_logged_step_of_each_attempt() -> None:
    first = [record(0, "r-abc-1", phase="starting"), record(2, "r-abc-1"), record(4, "r-abc-1")]
    first += [record(4, "r-abc-1", eval_loss=4.5)]  # logged twice: the last record counts
    # The second attempt (attempt 3: attempt 2 never trained) resumed from step 2 on one worker.
    second = [record(4, "r-abc-3", world_size=1, tokens_per_second=900.0, mfu=0.31), record(6, "r-abc-3")]
    rows = metrics.rows([first, second])
    assert [(r["attempt"], r["step"]) for r in rows] == [(1, 2), (1, 4), (3, 4), (3, 6)]
    assert rows[1]["eval_loss"] == 4.5 and rows[2]["world_size"] == 1 and rows[2]["mfu"] == 0.31

    frame = metrics.dataframe(rows)
    assert list(frame.columns) == list(metrics.COLUMNS)
    assert frame["step"].tolist() == [2, 4, 4, 6]
    assert frame.loc[frame.attempt == 3, "tokens_per_second"].tolist()[0] == 900.0


def test_records_that_name_no_job_count_attempts_in_order() -> None:
    rows = metrics.rows([[record(1, None)], [record(2, None)]])
    assert [r["attempt"] for r in rows] == [1, 2]


def test_s3_errors_say_in_one_line_what_to_do() -> None:
    where = "s3://bucket/runs/team-a/r/run.json"
    refused = BotoClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetObject")
    for error, says in (
        (NoCredentialsError(), "no AWS credentials"),
        (refused, "s3:GetObject and s3:ListBucket"),
    ):
        message = str(not_readable(error, where))
        assert message.startswith("S3 not readable") and says in message and where in message
        assert "\n" not in message


def test_a_failed_run_is_one_line_with_the_status_reason() -> None:
    run = TrainingRun({"metadata": {"name": "r", "namespace": "team-a"}, "spec": REQUIRED})
    failed = RunFailed(run, "NotAllowed", "runtimeEnv.secretEnv names Secret hf, not granted")
    assert str(failed) == "run team-a/r failed: NotAllowed: runtimeEnv.secretEnv names Secret hf, not granted"


def test_a_run_shows_as_an_html_summary() -> None:
    run = TrainingRun(
        {
            "metadata": {"name": "r", "namespace": "team-a"},
            "spec": REQUIRED,
            "status": {
                "phase": "Succeeded",
                "progress": {"step": 40, "maxSteps": 40, "loss": 3.25},
                "goodput": {"fraction": 0.5, "costUsd": 1.5},
                "record": {"exportedModelUri": "s3://bucket/runs/team-a/r/model"},
            },
        }
    )
    shown = run._repr_html_()
    for expected in ("team-a/r", "Succeeded", "40/40", "3.25", "1.5", "s3://bucket/runs/team-a/r/model"):
        assert expected in shown, expected
    assert run.exported_model_uri == "s3://bucket/runs/team-a/r/model" and run.cost_usd == 1.5


def test_neither_pandas_nor_matplotlib_nor_kubernetes_is_imported_until_used() -> None:
    """A fresh interpreter: importing the client, showing a run, a diff and a loss curve imports none of them
    (kubernetes comes with a Client, pandas with a DataFrame)."""
    script = textwrap.dedent(
        """
        import json, sys
        import fsdp_client
        from fsdp_client import plot, rundiff
        from fsdp_client.runs import TrainingRun
        run = TrainingRun({"metadata": {"name": "r", "namespace": "n"}, "spec": SPEC})
        run._repr_html_()
        rundiff.RunDiff("n/a", "n/b", [rundiff.Difference("x", 1, 2)])._repr_html_()
        plot.LossCurve(plot.curves([]))._repr_png_()
        before = sorted({m.split(".")[0] for m in sys.modules} & {"pandas", "matplotlib", "kubernetes"})
        fsdp_client.metrics.dataframe([])
        after = sorted({m.split(".")[0] for m in sys.modules} & {"pandas", "matplotlib"})
        print(json.dumps([before, after]))
        """
    ).replace("SPEC", json.dumps(REQUIRED))
    path = ":".join(str(REPO / folder) for folder in ("fsdp_client", "operator", "trainer"))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env={"PYTHONPATH": path}
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[], ["pandas"]]
