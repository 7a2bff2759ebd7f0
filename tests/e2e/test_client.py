"""The example notebook (examples/client.ipynb), executed as a user runs it, against the whole local product
(operator, KubeRay, the local Ray head training on CPU, S3): it drives runs through the Python client only
(create, follow the log, wait, metrics as a DataFrame, the loss curve, diff, a run from the first's export),
and the test reads back, through the client too, what a notebook user relies on."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

from fsdp_client import Client
from tests.support.demo import BUCKET, CORPUS, RUN_TIMEOUT
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO

NOTEBOOK = REPO / "examples" / "client.ipynb"


def outputs_of(notebook: Any, mime: str) -> list[Any]:
    return [
        output["data"][mime]
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if mime in output.get("data", {})
    ]


def printed(notebook: Any) -> str:
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream"
    )


def test_the_example_notebook_fine_tunes_compares_and_fine_tunes_again_from_the_export(
    namespace: str,
    lifecycle_operator: OperatorProcess,
    s3: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FSDP_NAMESPACE", namespace)
    monkeypatch.setenv("FSDP_STORAGE", f"s3://{BUCKET}/runs")
    monkeypatch.setenv("FSDP_DATA", f"s3://{BUCKET}/{CORPUS}")
    # The kernel is this environment's Python with the checkout's packages, as `pip install .` would give it;
    # Jupyter's and IPython's files go to the test's folder, not the home directory.
    packages = (REPO / folder for folder in ("fsdp_client", "operator", "trainer"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(map(str, packages)))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # A cell's bound is above the notebook's waits (timeout=RUN_TIMEOUT): their error says where a run was.
    NotebookClient(
        notebook,
        timeout=RUN_TIMEOUT + 60,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()

    client = Client(namespace)
    runs = {run.name.rsplit("-", 1)[1]: run for run in client.list()}
    assert sorted(runs) == ["a", "b", "c"]  # the misspelt one never reached the cluster
    assert {run.phase for run in runs.values()} == {"Succeeded"}, runs
    first, second, again = runs["a"], runs["b"], runs["c"]
    assert "spec.training.maxStep: Extra inputs are not permitted" in printed(notebook)

    # The log followed to the end, and the metric history of every logged step.
    log = printed(notebook)
    assert "step 12/12" in log and "step 12/12" in client.log(first)
    metrics = client.metrics(first)
    assert metrics["step"].tolist() == [2, 4, 6, 8, 10, 12]
    assert set(metrics["attempt"]) == {1} and set(metrics["world_size"]) == {1}
    assert all(math.isfinite(loss) for loss in metrics["loss"]) and (metrics["tokens_per_second"] > 0).all()
    assert metrics["eval_loss"].notna().iloc[-1]

    # What the notebook showed: the run's summary, the loss curve, the diff.
    summaries = [
        html for html in outputs_of(notebook, "text/html") if first.name in html and "Succeeded" in html
    ]
    assert summaries, "the run's HTML summary"
    assert outputs_of(notebook, "image/png"), "the loss curve"
    differences = client.diff(first, second).fields()
    assert differences["config.training.learning_rate"] == (3e-3, 1e-3)
    assert "image_digest" not in differences  # the same image ran both
    assert any("config.training.learning_rate" in html for html in outputs_of(notebook, "text/html"))

    # The third run started from the first's export and so began where the first ended, not from scratch.
    assert first.exported_model_uri and again.spec.model.source == first.exported_model_uri
    assert client.metrics(again)["loss"].iloc[0] < metrics["loss"].iloc[0] - 0.5
    assert [checkpoint.step for checkpoint in first.checkpoints] == [12, 6] and first.latest_checkpoint

    # What the run held and cost, at the operator's price for its instance type (lifecycle_env).
    assert first.goodput.gpu_hours_held > 0 and first.cost_usd is not None and first.cost_usd > 0
    assert re.search(r"GPU-hours held [0-9.]+, cost [0-9.]+ USD", printed(notebook)), printed(notebook)
