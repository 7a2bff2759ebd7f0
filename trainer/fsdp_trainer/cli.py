"""Command line: every TrainerConfig field is an option (generated from the contract, so --help documents
exactly what the operator can set), applied over an optional --config file, JSON string or s3:// object."""

from __future__ import annotations

import argparse
import enum
import json
import os
import types
import typing
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fsdp_trainer.contract import AttemptInfo, EfaPolicy, Precision, TrainerConfig
from fsdp_trainer.errors import ConfigError

DESCRIPTION = """FSDP2 fine-tuning on Ray Train.

Without torchrun, this is the Ray driver: it connects to RAY_ADDRESS (or starts a local Ray) and runs a
TorchTrainer with one Ray Train worker per GPU (workers x gpusPerWorker), or `workers` CPU workers (gloo)
when gpusPerWorker is 0. Under torchrun (or with --launcher direct) it runs the per-worker loop itself.

Options below override the --config document; nested fields use dotted names (--training.max-steps 10).
"""

LAUNCHERS = ("auto", "ray", "direct")


def _option(path: tuple[str, ...]) -> str:
    return "--" + ".".join(part.replace("_", "-") for part in path)


def _leaf_type(annotation: Any) -> Any:
    """X for X | None; the annotation itself otherwise."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _submodel(annotation: Any) -> type[BaseModel] | None:
    leaf = _leaf_type(annotation)
    return leaf if isinstance(leaf, type) and issubclass(leaf, BaseModel) else None


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error


def _help(field: FieldInfo) -> str:
    text = (field.description or "").replace("%", "%%")
    if field.default is not PydanticUndefined and field.default is not None:
        default = field.default.value if isinstance(field.default, enum.Enum) else field.default
        text += f" (default: {json.dumps(default)})"
    elif field.is_required():
        text += " (required unless given in --config)"
    return text


def _add_fields(
    parser: argparse.ArgumentParser, model: type[BaseModel], path: tuple[str, ...], group: Any
) -> None:
    for name, field in model.model_fields.items():
        field_path = (*path, name)
        nested = _submodel(field.annotation)
        if nested is not None:
            section = parser.add_argument_group(
                ".".join(field_path), (nested.__doc__ or "").strip().split("\n")[0] or None
            )
            _add_fields(parser, nested, field_path, section)
            continue
        leaf = _leaf_type(field.annotation)
        kwargs: dict[str, Any] = {
            "dest": ".".join(field_path),
            "default": argparse.SUPPRESS,
            "help": _help(field),
        }
        if leaf is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(leaf, type) and issubclass(leaf, enum.Enum):
            kwargs["choices"] = [member.value for member in leaf]
        elif leaf in (int, float, str):
            kwargs["type"] = leaf
            kwargs["metavar"] = leaf.__name__.upper()
        else:  # dicts and lists
            kwargs["type"] = _json_value
            kwargs["metavar"] = "JSON"
        group.add_argument(_option(field_path), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_trainer",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        help="TrainerConfig as a JSON file path, an inline JSON object, or an s3:// URI "
        "(camelCase or snake_case keys)",
    )
    parser.add_argument(
        "--submission-id",
        default=None,
        help="Identifies this submission in checkpoint manifests (checkpoint.resume=never ignores other "
        "submissions' checkpoints); default: a random id",
    )
    parser.add_argument(
        "--attempt-info",
        type=AttemptInfo.model_validate_json,
        default=AttemptInfo(),
        metavar="JSON",
        help="What the operator knows of this attempt (attempt, imageDigest, trainerPackageSha256): each "
        "rank's log goes to <run>/logs/attempt-<attempt>/rank-<k>.log (attempt 1 when unset), and the "
        "tracking run's tags",
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="ray: drive a Ray Train TorchTrainer; direct: run the per-worker loop in this process (torchrun "
        "or a single process); auto: direct under torchrun, else ray (default: auto)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    _add_fields(parser, TrainerConfig, (), parser.add_argument_group("run"))
    return parser


def _read_document(source: str) -> dict[str, Any]:
    if source.lstrip().startswith("{"):
        text = source
    elif source.startswith("s3://"):
        from fsdp_trainer.storage import Location

        text = Location.parse(source).read_text()
    else:
        text = Path(source).read_text()
    document = json.loads(text)
    if not isinstance(document, dict):
        raise ConfigError("--config must hold a JSON object")
    return document


def _to_field_names(model: type[BaseModel], document: dict[str, Any]) -> dict[str, Any]:
    """Rewrites camelCase keys to field names, recursing into sub-models only (dict-valued fields such as
    model.fromConfig keep their keys), so that dotted overrides land on the same keys."""
    by_alias = {field.alias or name: name for name, field in model.model_fields.items()}
    result: dict[str, Any] = {}
    for key, value in document.items():
        name = by_alias.get(key, key)
        nested = _submodel(model.model_fields[name].annotation) if name in model.model_fields else None
        result[name] = _to_field_names(nested, value) if nested and isinstance(value, dict) else value
    return result


def resolve_config(args: argparse.Namespace) -> TrainerConfig:
    """--config (if any) with every given option applied over it, validated against the schema (the
    cross-field rules are `check`'s)."""
    document = _to_field_names(TrainerConfig, _read_document(args.config)) if args.config else {}
    for dest, value in vars(args).items():
        if "." not in dest and dest not in TrainerConfig.model_fields:
            continue
        *parents, leaf = dest.split(".")
        target = document
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return absolute_local_paths(TrainerConfig.model_validate(document))


def absolute_local_paths(config: TrainerConfig) -> TrainerConfig:
    """Relative local paths are relative to where the command runs; Ray workers run elsewhere.

    Model and tokenizer sources change only when the path exists here: "Qwen/Qwen2.5-1.5B" is a hub id.
    """

    def local(path: str | None, must_exist: bool) -> str | None:
        if path is None or "://" in path or os.path.isabs(path) or (must_exist and not os.path.exists(path)):
            return path
        return os.path.abspath(path)

    data = config.data.model_copy(
        update={
            "source": local(config.data.source, True),
            "eval_source": local(config.data.eval_source, True),
        }
    )
    model = config.model.model_copy(
        update={"source": local(config.model.source, True), "tokenizer": local(config.model.tokenizer, True)}
    )
    storage = local(config.checkpoint.storage_path, False)
    checkpoint = config.checkpoint.model_copy(update={"storage_path": storage})
    return config.model_copy(update={"data": data, "model": model, "checkpoint": checkpoint})


def check(config: TrainerConfig) -> None:
    """Rules across fields that the schema cannot express."""
    if (config.model.source is None) == (config.model.from_config is None):
        raise ConfigError("set exactly one of model.source and model.fromConfig")
    if config.network.efa == EfaPolicy.REQUIRED and config.gpus_per_worker == 0:
        raise ConfigError("network.efa=required needs GPU workers (CPU training uses gloo over TCP)")
    if config.fsdp.mixed_precision == Precision.FP16:
        raise ConfigError(
            "fsdp.mixedPrecision fp16 needs loss scaling, which this trainer does not do (fp16 gradients "
            "underflow to zero without it); use bf16 (Ampere and newer: A10G, L4, A100, H100) or fp32"
        )
    if config.training.warmup_steps >= config.training.max_steps and config.training.warmup_steps > 0:
        raise ConfigError("training.warmupSteps must be below training.maxSteps")


def submission_id(args: argparse.Namespace) -> str:
    return str(args.submission_id or uuid.uuid4().hex)
