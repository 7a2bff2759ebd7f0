"""The command line: generated from the contract, so --help documents every option the operator can set."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from fsdp_trainer.cli import build_parser, check, resolve_config
from fsdp_trainer.contract import PROGRESS_FILE, ErrorKind, ProgressRecord, TrainerConfig
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.storage import Location
from tests.support.net import free_port
from tests.support.paths import REPO

BASE: dict[str, Any] = {
    "runName": "demo",
    "model": {"fromConfig": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}},
    "checkpoint": {"storagePath": "s3://bucket/runs"},
}


def leaf_options(model: type[BaseModel], prefix: str = "") -> list[str]:
    options = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name.replace('_', '-')}"
        nested = field.annotation
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            options.extend(leaf_options(nested, f"{dotted}."))
        else:
            options.append(f"--{dotted}")
    return options


def test_help_documents_every_config_field_with_its_description() -> None:
    text = build_parser().format_help()
    options = leaf_options(TrainerConfig)
    assert len(options) > 35
    for option in options:
        assert option in text, f"{option} missing from --help"
    assert "Gradient clipping norm; 0 disables it." in text
    assert "{required,preferred,disabled}" in text


def resolve(*argv: str) -> TrainerConfig:
    return resolve_config(build_parser().parse_args(list(argv)))


def test_camel_case_config_with_dotted_overrides(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, "training": {"maxSteps": 50, "learningRate": 1e-4}}))
    config = resolve("--config", str(path), "--training.max-steps", "10", "--workers", "4",
                     "--fsdp.sharding", "HYBRID_SHARD", "--no-checkpoint.export-model",
                     "--network.nccl-env", '{"NCCL_SOCKET_IFNAME": "eth0"}')  # fmt: skip
    assert config.training.max_steps == 10 and config.training.learning_rate == 1e-4
    assert config.workers == 4 and config.fsdp.sharding == "HYBRID_SHARD"
    assert config.checkpoint.export_model is False
    assert config.network.nccl_env == {"NCCL_SOCKET_IFNAME": "eth0"}


def test_inline_json_keeps_model_config_keys_as_given() -> None:
    config = resolve("--config", json.dumps(BASE))
    assert config.model.from_config == {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}


def test_everything_can_come_from_options_alone() -> None:
    config = resolve(
        "--run-name", "x", "--model.source", "Qwen/Qwen2.5-1.5B", "--checkpoint.storage-path", "s3://b/p"
    )
    assert config.model.source == "Qwen/Qwen2.5-1.5B", "a hub id is not a local path"


def test_relative_local_paths_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text("")
    config = resolve(
        "--config", json.dumps(BASE), "--data.source", "data.jsonl", "--checkpoint.storage-path", "out"
    )
    assert config.data.source == str(tmp_path / "data.jsonl")
    assert config.checkpoint.storage_path == os.path.join(tmp_path, "out")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model.source", "Qwen/Qwen2.5-1.5B"], "exactly one of model.source"),
        (["--network.efa", "required"], "needs GPU workers"),
        (["--training.warmup-steps", "100", "--training.max-steps", "100"], "warmupSteps"),
        (["--fsdp.mixed-precision", "fp16"], "fp16 needs loss scaling"),
    ],
)
def test_inconsistent_configs_are_config_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check(resolve("--config", json.dumps(BASE), *argv))


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError):
        resolve("--config", json.dumps({**BASE, "trainig": {}}))


def test_the_ray_driver_leaves_the_model_code_to_the_workers() -> None:
    """The job's driver only launches Ray Train, on the head: the training loop and transformers load in the
    workers that train, not in every attempt's driver as well (about 5 CPU-seconds and 180 MB each)."""
    probe = (
        "import sys, fsdp_trainer.driver; "
        "print([m for m in ('fsdp_trainer.loop', 'transformers') if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(REPO / "trainer")},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_no_two_trainer_modules_import_each_other() -> None:
    """Imports inside functions count too: a cycle means neither module can be read without the other."""
    package = REPO / "trainer" / "fsdp_trainer"
    imports: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        found = imports.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "fsdp_trainer":
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_trainer."):
                found.add(str(node.module).split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("fsdp_trainer."))

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for imported in imports.get(todo.pop(), set()) - seen:
                seen.add(imported)
                todo.append(imported)
        return seen

    cycles = sorted(module for module in imports if module in reachable(module))
    assert cycles == [], f"modules that import themselves through others: {cycles}"


def test_a_missing_data_source_fails_in_the_driver_before_ray_is_asked_for_workers(
    s3_storage: str, tmp_path: Path
) -> None:
    """The driver checks a URI data source as the workers would read it: a wrong one fails the attempt at
    once, recorded for the operator as a permanent data error, not after every worker has started and loaded
    the model. RAY_ADDRESS names a port where nothing listens: reaching Ray at all would hang or fail."""
    missing = s3_storage.replace("/runs", "/data/no-such-corpus.jsonl")
    config = {**BASE, "data": {"source": missing}, "checkpoint": {"storagePath": s3_storage}}
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_trainer", "--config", json.dumps(config), "--submission-id", "s-1"],
        env={**os.environ, "PYTHONPATH": str(REPO / "trainer"), "RAY_ADDRESS": f"127.0.0.1:{free_port()}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    record = ProgressRecord.model_validate_json(
        Location.parse(s3_storage).child(f"default/demo/{PROGRESS_FILE}").read_text()
    )
    assert record.phase == "failed" and record.error_kind == ErrorKind.DATA and record.submission_id == "s-1"
    assert record.error and "no-such-corpus.jsonl" in record.error, record.error
