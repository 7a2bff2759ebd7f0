"""The contract between the operator and the trainer: pydantic only, no torch, no Ray.

The operator embeds the config sections below in its CRD (they are the one source of the field docs), hands
a `TrainerConfig` to the trainer as JSON, and reads back what the trainer writes next to its checkpoints:
a `ProgressRecord` while training and a `CheckpointManifest` inside every checkpoint. The operator writes
the `RunRecord` (run.json) in the same place, so the evidence of a run outlives its custom resource.

Storage layout under `<checkpoint.storagePath>/<namespace>/<runName>/` (the namespace keeps runs of one name
in two namespaces apart):
    progress.json                       latest ProgressRecord (rank 0, every logging interval)
    metrics/<attempt>.jsonl             ProgressRecord history of one attempt (flushed at checkpoints, end)
    logs/attempt-<n>/rank-<k>.log       each rank's log lines of operator attempt n (trainer, runlog.py)
    logs/attempt-<n>/driver.log         the Ray job's driver log of attempt n (operator, when the job ends)
    model/                              consolidated Hugging Face model exported at the end (safetensors)
    mlflow.json                         MlflowRunRef: the MLflow run every attempt logs to (tracking on)
    run.json                            RunRecord (operator)
    checkpoint_<...>/                   Ray Train checkpoint directories (DCP shards + .metadata)
        fsdp_manifest.json              CheckpointManifest, written last: no manifest, no checkpoint
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

PROGRESS_FILE = "progress.json"
RUN_RECORD_FILE = "run.json"
MANIFEST_FILE = "fsdp_manifest.json"
METRICS_DIR = "metrics"
LOGS_DIR = "logs"
DRIVER_LOG_FILE = "driver.log"
MODEL_DIR = "model"
MLFLOW_RUN_FILE = "mlflow.json"
FORENSICS_DIR = "forensics"
# Where Ray Train's NCCL hang detector (Ray >= 2.60) stores its diagnostics of a confirmed hang, under the
# run's prefix (its experiment directory): ray/train/v2/_internal/constants.py HANG_DETECTOR_DIRNAME.
HANG_DETECTOR_DIR = "hang_detector"
# The Kubernetes node of a worker pod, given to it through the downward API: hang forensics name it.
NODE_NAME_ENV = "FSDP_NODE_NAME"
DCP_METADATA_FILE = ".metadata"
SCHEMA_VERSION = 1
# Text a person types (sources, paths, URIs, env values): without control characters or bidirectional
# overrides, which make a value read otherwise than it acts. As a schema pattern the apiserver refuses such
# a value at admission, naming the field.
PLAIN_TEXT = r"^[^\x00-\x1f\x7f\x{202a}-\x{202e}\x{2066}-\x{2069}]*$"
MAX_URI = 1024
# model.fromConfig, a free-form map: at most this deep (the map itself is level 1; transformers' configs
# nest 3) and this long as compact JSON. A 1,500-deep map is valid JSON to the apiserver and past Python's
# recursion limit; and the config travels on the job's command line, where one argument holds 128 KiB.
MAX_FROM_CONFIG_DEPTH = 8
MAX_FROM_CONFIG_BYTES = 64 << 10
# NCCL and libfabric settings: the only environment network.ncclEnv may set.
NCCL_ENV_NAME = r"^(NCCL|FI|OFI)_[A-Z0-9_]{1,120}$"


class ContractModel(BaseModel):
    """camelCase on the wire (Kubernetes style), snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=True
    )

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)


# ----------------------------------------------------------------------------------------------------------
# Config sections (embedded in the FSDPTrainingRun spec)


class ShardingStrategy(StrEnum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    HYBRID_SHARD = "HYBRID_SHARD"
    NO_SHARD = "NO_SHARD"


class Precision(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class ActivationCheckpointing(StrEnum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"
    SELECTIVE_OP = "selective-op"


class Schedule(StrEnum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"


class EfaPolicy(StrEnum):
    REQUIRED = "required"
    PREFERRED = "preferred"
    DISABLED = "disabled"


class SlowFabricPolicy(StrEnum):
    """What a failed fabric check leads to."""

    FAIL = "fail"  # the run fails, naming the pod, node and figures
    AVOID_NODE = "avoidNode"  # the suspect node is labelled and the attempt restarts on a cluster without it


class ModelSpec(ContractModel):
    source: str | None = Field(
        default=None,
        max_length=512,
        pattern=PLAIN_TEXT,
        description="Where the pretrained model comes from: a Hugging Face hub id (e.g. Qwen/Qwen2.5-1.5B), "
        "an s3:// prefix holding config, weights and tokenizer (downloaded once per node), or a local path "
        "inside the image. Exactly one of source and fromConfig is set.",
    )
    revision: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[A-Za-z0-9._/-]+$",
        description="Hub revision (branch, tag or commit) when source is a hub id.",
    )
    from_config: dict[str, Any] | None = Field(
        default=None,
        max_length=256,
        description="A transformers model config (must contain model_type) to initialise randomly instead "
        "of loading weights: the AWS sample's parity mode and the tiny CPU demo.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    tokenizer: str | None = Field(
        default=None,
        max_length=512,
        pattern=PLAIN_TEXT,
        description="Tokenizer source (hub id, s3:// prefix or local path); defaults to source. "
        "'byte-level' is the built-in 256-symbol byte tokenizer, needing no download.",
    )

    @field_validator("from_config")
    @classmethod
    def _from_config_bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if _nesting_exceeds(value, MAX_FROM_CONFIG_DEPTH):
            raise ValueError(
                f"spec.model.fromConfig is nested deeper than {MAX_FROM_CONFIG_DEPTH} levels (maps and lists)"
            )
        size = len(json.dumps(value, separators=(",", ":")).encode())
        if size > MAX_FROM_CONFIG_BYTES:
            raise ValueError(
                f"spec.model.fromConfig is {size} bytes as JSON, more than {MAX_FROM_CONFIG_BYTES} bytes"
            )
        return value


def _nesting_exceeds(value: Any, depth: int) -> bool:
    """Whether maps and lists nest deeper than `depth` (`value` itself is level 1); iterative, so that no
    depth is too deep to measure."""
    level, current = 0, [value]
    while current:
        level += 1
        if level > depth:
            return True
        current = [
            child
            for node in current
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
    return False


# What a run with an adapter needs beyond the DLC's packages (the DLC bundle has no peft; every one of peft's
# own dependencies is in it): the operator adds it to the job's runtime env (`pip`), so no image is changed.
ADAPTER_REQUIREMENT = "peft==0.21.2"


class AdapterSpec(ContractModel):
    """LoRA (Hu et al. 2021, through peft): the pretrained weights stay frozen and only low-rank updates of
    the target modules are trained, checkpointed and exported."""

    rank: int = Field(default=16, ge=1, le=1024, description="The rank r of each update B @ A.")
    alpha: int = Field(default=32, ge=1, description="Scale: the update is multiplied by alpha / rank.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter's input in training.")
    target_modules: list[Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9_.]+$")]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        max_length=64,
        description="Names (or name suffixes) of the linear layers to adapt; default: every projection of a "
        "Llama/Qwen decoder layer.",
    )
    export_merged: bool = Field(
        default=False,
        description="At the end, also export the base model with the adapter merged into it (safetensors "
        "under model/); the adapter alone is always exported (under adapter/, in peft's format).",
    )
    init_from: str | None = Field(
        default=None,
        max_length=MAX_URI,
        pattern=PLAIN_TEXT,
        description="An adapter exported by an earlier run (its adapter/ directory: local path or s3:// "
        "URI) to start from instead of a new one; its rank and alpha must be these.",
    )


class FsdpSpec(ContractModel):
    sharding: ShardingStrategy = Field(
        default=ShardingStrategy.FULL_SHARD,
        description="FULL_SHARD reshards parameters after forward; SHARD_GRAD_OP keeps them gathered "
        "until backward; HYBRID_SHARD replicates across nodes and shards within a node (2-D mesh, needs "
        "two or more workers); NO_SHARD replicates everything (DDP-like).",
    )
    mixed_precision: Precision = Field(
        default=Precision.BF16, description="Parameter dtype for compute; gradients reduce in fp32."
    )
    activation_checkpointing: ActivationCheckpointing = Field(
        default=ActivationCheckpointing.NONE,
        description="Recompute activations in backward: none, full (every decoder layer), selective "
        "(every other layer) or selective-op (in every layer, keep the outputs of attention and of every "
        "other matmul and recompute the rest, as torchtitan's per-operation policy does).",
    )
    cpu_offload: bool = Field(default=False, description="Offload sharded parameters and optimizer to CPU.")
    compile: bool = Field(default=False, description="torch.compile each decoder layer before sharding.")
    reduce_every_micro_step: bool = Field(
        default=True,
        description="Reduce-scatter gradients after every micro-step (as torchtitan does): each rank then "
        "accumulates only its shard of the gradients. false reduces once, after the last micro-step of a "
        "step, for fewer collectives, but keeps every rank's full unsharded fp32 gradients between "
        "micro-steps (about 4 bytes per parameter: 28 GB for a 7B model).",
    )
    adapter: AdapterSpec | None = Field(
        default=None,
        description="Train a LoRA adapter instead of every weight (needs model.source: the pretrained model "
        "it adapts). Checkpoints hold the adapter and its optimizer state only.",
    )


class TrainingSpec(ContractModel):
    max_steps: int = Field(default=100, ge=1, description="Optimizer steps to train for.")
    micro_batch_size: int = Field(default=1, ge=1, description="Sequences per device per micro-step.")
    grad_accumulation: int = Field(
        default=1,
        ge=1,
        description="Micro-steps per optimizer step; ignored when globalBatchSize is set (then derived).",
    )
    global_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Sequences per optimizer step, part of the recipe: gradient accumulation is derived as "
        "globalBatchSize / (world size x microBatchSize), and a world size or microBatchSize that does not "
        "divide it fails the run (a config error). A resume at another world size keeps the global batch, "
        "so tokens per step, the learning-rate schedule and the data position stay exactly as they were. "
        "Unset, the global batch is world size x microBatchSize x gradAccumulation, except that a resume "
        "keeps the global batch its checkpoint records (when world size x microBatchSize divides it; else "
        "it fails, naming both).",
    )
    sequence_length: int = Field(default=2048, ge=8, le=1_048_576, description="Tokens per sequence.")
    learning_rate: float = Field(default=2e-5, gt=0, le=1, description="Peak AdamW learning rate.")
    min_learning_rate_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak."
    )
    schedule: Schedule = Field(default=Schedule.COSINE, description="Decay after warmup.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, ge=0, description="Gradient clipping norm; 0 disables it.")
    seed: int = Field(default=0, ge=0, description="Seed for initialisation, data order and dropout.")
    loss_chunk_tokens: int = Field(
        default=0,
        ge=0,
        description="Compute the output projection and cross-entropy this many tokens at a time, "
        "recomputing each chunk's logits in backward, so the logits of a whole micro-batch never exist at "
        "once (large vocabularies); 0 computes them in one piece.",
    )
    log_every: int = Field(
        default=10,
        ge=1,
        description="Steps between metric records; each costs a host sync and two small all-reduces.",
    )
    max_non_finite_steps: int = Field(
        default=3,
        ge=1,
        description="Steps in a row whose loss or gradient norm is not finite (inf or NaN) that fail the run "
        "(reason NonFiniteLoss, not retried). Such a step's update is skipped on every worker: weights, "
        "optimizer state and learning rate stay as they were, and its batch is not retried.",
    )

    def accumulation_for(self, world_size: int, checkpoint_global_batch: int | None = None) -> int:
        """Micro-steps per optimizer step at `world_size`: derived from globalBatchSize when set, else from
        the resumed checkpoint's global batch when given, else gradAccumulation. ValueError when the world
        size and micro-batch size do not divide the global batch."""
        if self.global_batch_size is not None:
            global_batch = self.global_batch_size
            source = f"training.globalBatchSize {global_batch}"
        elif checkpoint_global_batch is not None:
            global_batch = checkpoint_global_batch
            source = f"the resumed checkpoint's global batch {global_batch} (training.globalBatchSize unset)"
        else:
            return self.grad_accumulation
        per_micro_step = world_size * self.micro_batch_size
        if global_batch % per_micro_step:
            raise ValueError(
                f"{source} is not divisible by world size {world_size} x training.microBatchSize "
                f"{self.micro_batch_size} = {per_micro_step} sequences per micro-step; choose a world size "
                "and microBatchSize whose product divides it"
            )
        return global_batch // per_micro_step


class DataFormat(StrEnum):
    """How a row becomes tokens (spec.data.format)."""

    TEXT = "text"  # one document per row: continued pre-training, every token learned
    MESSAGES = "messages"  # a conversation (role/content turns) rendered with the chat template
    PROMPT_COMPLETION = "promptCompletion"  # a prompt and its completion, tokenised one after the other


class LossOn(StrEnum):
    """Which tokens of a messages or promptCompletion row the loss is computed on."""

    ANSWERS = "answers"  # the assistant turns, or the completion (TRL's and torchtune's default)
    ALL = "all"  # every token, the prompts too


class OverLength(StrEnum):
    """What happens to a row longer than training.sequenceLength once tokenised."""

    TRUNCATE = "truncate"  # its first sequenceLength tokens are kept
    DROP = "drop"  # it is left out


# A chat template is Jinja: lines and indentation are part of it, other control characters are not.
TEMPLATE_TEXT = r"^[^\x00-\x08\x0b-\x1f\x7f\x{202a}-\x{202e}\x{2066}-\x{2069}]*$"
FIELD_NAME = r"^[A-Za-z0-9_.-]+$"
# What, besides the source, decides the samples a run trains on (its resume fingerprint holds them).
FORMATTING_FIELDS = (
    "format",
    "messages_field",
    "prompt_field",
    "completion_field",
    "loss_on",
    "chat_template",
    "over_length",
    "packing",
)


class DataSpec(ContractModel):
    source: str = Field(
        default="synthetic",
        max_length=MAX_URI,
        pattern=PLAIN_TEXT,
        description="'synthetic' for random tokens (the AWS sample), or a jsonl/parquet file or directory "
        "(local path, s3:// or hf://datasets/... URI) with one example per row (see format).",
    )
    format: DataFormat = Field(
        default=DataFormat.TEXT,
        description="text: a document per row (textField), every token learned; messages: a conversation per "
        "row (messagesField: a list of {role, content}) rendered with the tokenizer's chat template (or "
        "chatTemplate); promptCompletion: promptField then completionField, then EOS.",
    )
    text_field: str = Field(
        default="text", max_length=128, pattern=FIELD_NAME, description="Column or key holding the text."
    )
    messages_field: str = Field(
        default="messages",
        max_length=128,
        pattern=FIELD_NAME,
        description="Column or key holding the conversation (format messages).",
    )
    prompt_field: str = Field(
        default="prompt",
        max_length=128,
        pattern=FIELD_NAME,
        description="Column or key holding the prompt (format promptCompletion).",
    )
    completion_field: str = Field(
        default="completion",
        max_length=128,
        pattern=FIELD_NAME,
        description="Column or key holding the completion (format promptCompletion).",
    )
    loss_on: LossOn = Field(
        default=LossOn.ANSWERS,
        description="answers: the loss is on the assistant turns (messages) or the completion "
        "(promptCompletion) only; all: on every token. Text rows always learn every token.",
    )
    chat_template: str | None = Field(
        default=None,
        max_length=16 << 10,
        pattern=TEMPLATE_TEXT,
        description="Jinja chat template for format messages, replacing the tokenizer's; a tokenizer without "
        "a template needs it.",
    )
    over_length: OverLength = Field(
        default=OverLength.TRUNCATE,
        description="A row longer than training.sequenceLength once tokenised: truncate keeps its first "
        "sequenceLength tokens, drop leaves it out. Either way it is counted and reported, as are rows that "
        "do not parse.",
    )
    packing: bool = Field(
        default=True,
        description="Pack several examples into each sequence, each attending only to itself (positions "
        "restart at each example); off: one example per sequence, padded.",
    )
    eval_source: str | None = Field(
        default=None,
        max_length=MAX_URI,
        pattern=PLAIN_TEXT,
        description="Held-out evaluation data in the same formats; default: evalFraction.",
    )
    eval_fraction: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="Share of the source held out when evalSource is unset, in whole shards (byte ranges of "
        "a jsonl file, row groups of a parquet file).",
    )
    eval_every: int = Field(default=0, ge=0, description="Steps between evaluations; 0 evaluates at the end.")
    eval_batches: int = Field(default=8, ge=1, description="Batches per evaluation.")

    def fields(self) -> list[str]:
        """The columns this format reads."""
        if self.format == DataFormat.MESSAGES:
            return [self.messages_field]
        if self.format == DataFormat.PROMPT_COMPLETION:
            return [self.prompt_field, self.completion_field]
        return [self.text_field]

    def learned_tokens(self) -> str:
        """What the loss is computed on, in words (the run record and describe say it)."""
        if self.format == DataFormat.TEXT or self.loss_on == LossOn.ALL:
            return "all tokens"
        return "assistant turns" if self.format == DataFormat.MESSAGES else "completions"


class CheckpointSpec(ContractModel):
    storage_path: str = Field(
        max_length=MAX_URI,
        pattern=PLAIN_TEXT,
        description="Where checkpoints, the progress record and run.json go: an s3:// prefix, under which "
        "each run has <namespace>/<runName>/ (the trainer run by hand also takes a local path).",
    )
    every_steps: int = Field(default=50, ge=1, description="Steps between checkpoints.")
    keep: int = Field(default=3, ge=1, description="Checkpoints kept; older ones are deleted.")
    resume: str = Field(
        default="auto",
        max_length=MAX_URI,
        pattern=PLAIN_TEXT,
        description="'auto' resumes from the latest complete checkpoint of this run, 'never' starts fresh, "
        "anything else is the URI of a checkpoint to start from.",
    )
    export_model: bool = Field(
        default=True, description="At the end, write a consolidated Hugging Face model (safetensors)."
    )


class NetworkSpec(ContractModel):
    efa: EfaPolicy = Field(
        default=EfaPolicy.PREFERRED,
        description="required: NCCL must use Libfabric/EFA and a socket fallback stops the run; "
        "preferred: use EFA, report a fallback as TransportDegraded; disabled: no EFA devices or settings.",
    )
    nccl_env: dict[str, Annotated[str, Field(max_length=MAX_URI, pattern=PLAIN_TEXT)]] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra NCCL_* / FI_* / OFI_* environment for the workers (no other names).",
    )

    @field_validator("nccl_env")
    @classmethod
    def _only_nccl_names(cls, env: dict[str, str]) -> dict[str, str]:
        others = sorted(name for name in env if not re.fullmatch(NCCL_ENV_NAME, name))
        if others:
            raise ValueError(f"only NCCL_*, FI_* and OFI_* names are allowed, not {', '.join(others)}")
        return env

    bandwidth_probe_mb: int = Field(
        default=64,
        ge=0,
        description="The fabric check's largest all-reduce size in MiB (its sweep doubles from 1 MiB up to "
        "this, within a few seconds); 0 skips the bandwidth measurements.",
    )
    min_bus_bandwidth_gbps: float | None = Field(
        default=None,
        gt=0,
        description="The fabric check's threshold: the all-reduce bus bandwidth (GB/s, 10^9 bytes per "
        "second, as nccl-tests reports busbw) at the sweep's largest size, and the least any link between "
        "two pods may carry. Default: the platform's figure for the workers' instance type, else the "
        "operator's table (EFA instance types only); none: the figures are recorded, not judged.",
    )
    slow_fabric: SlowFabricPolicy = Field(
        default=SlowFabricPolicy.AVOID_NODE,
        description="Below the threshold: avoidNode labels the node the slow links share (when one does) and "
        "restarts on a cluster whose pods avoid it; fail (or no single node to blame) fails the run.",
    )


class MlflowConfig(ContractModel):
    tracking_uri: str = Field(
        max_length=MAX_URI,
        pattern=r"^https?://[^\s/@]+(/\S*)?$",
        description="The MLflow tracking server (http:// or https://, without user:password@: the URI is "
        "recorded in run.json and logged as a param), reached through its REST API. "
        "Credentials, if the server needs them, come from the environment as for MLflow's own client "
        "(MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD).",
    )
    experiment_name: str | None = Field(
        default=None,
        max_length=500,
        pattern=PLAIN_TEXT,
        description="The MLflow experiment the run is logged in, created if missing; default: the run's "
        "namespace.",
    )
    registered_model_name: str | None = Field(
        default=None,
        max_length=256,
        pattern=PLAIN_TEXT,
        description="Register the exported model, once uploaded as the run's model/ artifacts, as a new "
        "version of this registered model (created if missing); its version number is tagged on the run. "
        "Unset: the model is an artifact only.",
    )


class TrackingConfig(ContractModel):
    mlflow: MlflowConfig | None = Field(
        default=None,
        description="Log params, metrics, tags and the exported model to MLflow: one MLflow run per "
        "training run, continued by every restart. A tracking server that cannot be reached costs a "
        "warning, never the training.",
    )


def world_sizes(workers: int, min_workers: int | None, gpus_per_worker: int) -> range:
    """Every world size (training processes) an attempt may start on: Ray Train's elastic range runs from
    minWorkers to workers nodes' worth of processes, any number in between (driver.scaling_workers)."""
    per_node = max(gpus_per_worker, 1)
    fewest = workers if min_workers is None else min(min_workers, workers)
    return range(fewest * per_node, workers * per_node + 1)


def unusable_world_sizes(
    workers: int,
    min_workers: int | None,
    gpus_per_worker: int,
    training: TrainingSpec,
    sharding: ShardingStrategy,
) -> str | None:
    """Why some world size of the elastic range could not train, or None: each must divide
    training.globalBatchSize with microBatchSize and, under HYBRID_SHARD, be whole nodes. A size found only
    after a resize would otherwise end the run mid-way with a permanent error; the operator refuses such a
    spec when it first sees it, and the trainer again before any worker starts."""
    per_node = max(gpus_per_worker, 1)
    sizes = world_sizes(workers, min_workers, gpus_per_worker)
    reasons = []
    for size in sizes:
        try:
            training.accumulation_for(size)
        except ValueError:
            reasons.append(
                f"{size} (training.globalBatchSize {training.global_batch_size} is not divisible "
                f"by {size} x training.microBatchSize {training.micro_batch_size})"
            )
            continue
        if sharding == ShardingStrategy.HYBRID_SHARD and size % per_node:
            reasons.append(f"{size} (HYBRID_SHARD needs whole nodes of {per_node} processes)")
    if not reasons:
        return None
    return (
        f"cluster.minWorkers {min_workers}: the run may train on {sizes.start} to {sizes[-1]} processes, "
        f"and cannot on {'; '.join(reasons)}. Choose cluster.minWorkers, cluster.workers and "
        "training.globalBatchSize so that every size in the range divides it"
    )


class TrainerConfig(ContractModel):
    """Everything the trainer needs; the operator builds it from the FSDPTrainingRun spec."""

    run_name: str = Field(description="Name of the run; the directory under <storagePath>/<namespace>.")
    namespace: str = Field(
        default="default",
        description="Namespace of the FSDPTrainingRun: runs of one name in two namespaces never share a "
        "prefix.",
    )
    workers: int = Field(default=1, ge=1, description="Ray Train workers (one per node).")
    min_workers: int | None = Field(
        default=None,
        ge=1,
        description="Elastic: the fewest workers (nodes) an attempt trains on; Ray Train starts and restarts "
        "on what the cluster has between this and `workers`, and grows back when nodes return. None: "
        "exactly `workers`.",
    )
    gpus_per_worker: int = Field(
        default=0, ge=0, description="GPUs per worker; one training process per GPU. 0 trains on CPU (gloo)."
    )
    cpus_per_worker: float = Field(default=1, gt=0, description="CPUs per worker when training on CPU.")
    max_failures: int = Field(
        default=0, ge=0, description="In-job retries by Ray Train before the job fails."
    )
    model: ModelSpec
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    checkpoint: CheckpointSpec
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    tracking: TrackingConfig | None = Field(default=None, description="Experiment tracking (MLflow).")
    secret_env_names: list[str] = Field(
        default_factory=list,
        description="Environment variables holding secrets (spec.runtimeEnv.secretEnv): their values are "
        "redacted from the logs the trainer writes.",
    )

    def run_uri(self) -> str:
        """The run's storage prefix: checkpoints, progress, metrics, the exported model and run.json."""
        return run_prefix(self.checkpoint.storage_path, self.namespace, self.run_name)

    def world_sizes(self) -> range:
        """Every world size (training processes) an attempt may start on (see `world_sizes`)."""
        return world_sizes(self.workers, self.min_workers, self.gpus_per_worker)

    def unusable_world_sizes(self) -> str | None:
        """Why some world size of the elastic range could not train, or None (see `unusable_world_sizes`)."""
        return unusable_world_sizes(
            self.workers, self.min_workers, self.gpus_per_worker, self.training, self.fsdp.sharding
        )

    def resume_fingerprint(self) -> str:
        """What must match for a checkpoint to be resumed: the model and tokenizer, the sequence length, the
        data and its order (seed). A checkpoint with another fingerprint is never loaded."""
        data = self.data
        relevant: dict[str, Any] = {
            "model": self.model.model_dump(mode="json", by_alias=True, exclude_none=True),
            "sequenceLength": self.training.sequence_length,
            "seed": self.training.seed,
            "data": [data.source, data.text_field, data.eval_source, data.eval_fraction],
        }
        formatting = data.model_dump(
            mode="json", by_alias=True, exclude_defaults=True, include=set(FORMATTING_FIELDS)
        )
        if formatting:  # only what a non-default format sets: a text run's fingerprint stays what it was
            relevant["dataFormat"] = formatting
        if self.fsdp.adapter is not None:  # its checkpoints hold an adapter of this shape only
            relevant["adapter"] = self.fsdp.adapter.model_dump(
                mode="json", by_alias=True, exclude={"export_merged"}, exclude_none=True
            )
        canonical = json.dumps(relevant, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------
# What the trainer writes and the operator reads


class Versions(ContractModel):
    python: str | None = None
    ray: str | None = None
    torch: str | None = None
    transformers: str | None = None
    cuda: str | None = None
    nccl: str | None = None


class Transport(StrEnum):
    EFA_GPUDIRECT = "efa-gpudirect"  # Libfabric/EFA with GPUDirect RDMA
    EFA = "efa"  # Libfabric/EFA, staged through host memory
    SOCKET = "socket"  # NCCL's TCP socket transport: the silent fallback
    GLOO = "gloo"  # CPU training
    SINGLE = "single-node"  # intra-node only (NVLink/PCIe/SHM); no network transport used
    UNKNOWN = "unknown"


class TransportReport(ContractModel):
    observed: Transport = Field(description="The network transport NCCL (or gloo) actually used.")
    evidence: list[str] = Field(default_factory=list, description="Log lines that show it.")
    bus_bandwidth_gbps: float | None = Field(
        default=None, description="All-reduce bus bandwidth from the probe, in GB/s."
    )
    fallback_pods: list[str] = Field(
        default_factory=list,
        description="Pods whose NCCL sent to other nodes over TCP sockets (the rest used what `observed` "
        "does not say): a node's EFA problem where only some pods are named.",
    )


class FabricLink(ContractModel):
    """Bandwidth of one pod-to-pod direction, measured while every pod sends to one neighbour at once."""

    source_pod: str
    target_pod: str
    gbps: float = Field(description="GB/s (10^9 bytes per second) the target received at.")


class FabricPod(ContractModel):
    pod: str = Field(description="The host name: the Ray pod on Kubernetes.")
    node: str | None = Field(default=None, description="The Kubernetes node, where the pod is told it.")
    ranks: list[int] = Field(default_factory=list)


class SweepPoint(ContractModel):
    size_bytes: int
    bus_bandwidth_gbps: float
    seconds: float = Field(description="One all-reduce of this size, the slowest rank's.")


class FabricReport(ContractModel):
    """The fabric check: what every attempt measures on its own pods, before its first training step."""

    backend: str = Field(description="The torch.distributed backend, initialised as training uses it.")
    transport: Transport = Field(description="The network the collectives used (NCCL's log, or gloo).")
    libraries: list[str] = Field(
        default_factory=list,
        description="Network libraries this process has loaded (libfabric, the aws-ofi-nccl plugin) after "
        "NCCL initialised; GPU workers only.",
    )
    pods: list[FabricPod] = Field(default_factory=list)
    sweep: list[SweepPoint] = Field(default_factory=list)
    links: list[FabricLink] = Field(default_factory=list)
    bus_bandwidth_gbps: float | None = Field(
        default=None, description="At the sweep's largest size: the figure judged against the threshold."
    )
    min_bus_bandwidth_gbps: float | None = Field(default=None, description="The threshold applied, if any.")
    passed: bool = True
    suspect_pod: str | None = Field(default=None, description="The pod every slow link touches, if one does.")
    suspect_node: str | None = None
    message: str = ""
    seconds: float = Field(default=0.0, description="What the check cost this attempt, wall time.")


class ErrorKind(StrEnum):
    """Why a run failed; every kind but RUNTIME is permanent: retrying the same input fails the same way."""

    CONFIG = "config"  # invalid or inconsistent configuration, unusable resume URI
    DATA = "data"  # data source missing, unreadable, without the text field, or too small
    MODEL = "model"  # model or tokenizer could not be loaded or built
    OOM = "oom"  # device out of memory
    TRANSPORT = "transport"  # the network policy was violated (e.g. EFA required, socket used)
    NON_FINITE_LOSS = "non-finite-loss"  # the loss or gradient norm stayed inf/NaN (maxNonFiniteSteps)
    FABRIC = "fabric"  # the fabric check found the network below network.minBusBandwidthGbps
    STORAGE_ACCESS = "storage-access"  # the pod's AWS identity (or none) may not read/write a run's S3 prefix
    RUNTIME = "runtime"  # anything else (lost workers, storage hiccups, collective timeouts): retryable


PERMANENT_ERROR_KINDS = frozenset(kind for kind in ErrorKind if kind is not ErrorKind.RUNTIME)


class SetupStage(StrEnum):
    """What the trainer is doing before its first step; heartbeats name it so slow setup is not a hang."""

    INITIALIZING = "initializing"  # process group, devices
    DOWNLOADING_MODEL = "downloading-model"
    LOADING_DATA = "loading-data"  # reading and tokenising the corpus
    LOADING_CHECKPOINT = "loading-checkpoint"
    PROBING_TRANSPORT = "probing-transport"  # the fabric check
    COMPILING = "compiling"


class TrainingData(ContractModel):
    """What a run learns from: its data format, the tokens the loss is on, and what became of the rows read
    so far (by rank 0: the held-out shards and its own training streams' shards)."""

    format: DataFormat
    learned: str = Field(description="The tokens the loss is on: all tokens, assistant turns or completions.")
    packed: bool
    rows: int = 0
    unparsable: int = 0
    truncated: int = 0
    dropped: int = 0


class ProgressRecord(ContractModel):
    schema_version: int = SCHEMA_VERSION
    run_name: str
    phase: Literal["starting", "training", "finished", "failed"]
    submission_id: str | None = Field(
        default=None, description="The job submission that wrote this record (one per attempt)."
    )
    stage: SetupStage | None = Field(
        default=None, description="While phase is starting: the setup stage of the latest heartbeat."
    )
    step: int = 0
    max_steps: int
    loss: float | None = None
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    tokens_per_second: float | None = None
    tokens_per_second_per_device: float | None = None
    step_time_seconds: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    checkpoint_blocked_seconds: float | None = Field(
        default=None,
        description="Seconds the latest checkpoint held training up (staging the state off the device); "
        "writing and uploading it continue in the background.",
    )
    drain_checkpoint_step: int | None = Field(
        default=None,
        description="The step of the checkpoint saved when Ray announced that a node of this attempt was "
        "draining (a preemption); training then held until the node went.",
    )
    drain_checkpoint_seconds: float | None = Field(
        default=None,
        description="Seconds from the drain notice at a step boundary to that checkpoint durable.",
    )
    tokens_seen: int = 0
    non_finite_steps: int = Field(
        default=0,
        description="Steps of this attempt whose update was skipped because the loss or gradient norm was "
        "not finite on some worker.",
    )
    world_size: int = 1
    resumed_from_step: int | None = None
    transport: TransportReport | None = None
    fabric: FabricReport | None = None
    versions: Versions = Field(default_factory=Versions)
    exported_model_uri: str | None = None
    training_data: TrainingData | None = None
    adapter_bytes: int | None = Field(
        default=None,
        description="A LoRA run's trainable weights in bytes (fp32): what its export holds, and a third of "
        "what its checkpoints hold (with the optimizer's two moments).",
    )
    error: str | None = None
    error_kind: ErrorKind | None = None
    updated_at: dt.datetime


class CheckpointManifest(ContractModel):
    schema_version: int = SCHEMA_VERSION
    run_name: str
    step: int
    loss: float | None = None
    tokens_seen: int
    world_size: int
    created_at: dt.datetime
    versions: Versions = Field(default_factory=Versions)
    files: dict[str, int] = Field(description="Every file of the checkpoint with its size in bytes.")
    submission_id: str | None = Field(
        default=None, description="The trainer submission that wrote it (resume=never ignores others)."
    )
    fingerprint: str | None = Field(
        default=None,
        description="TrainerConfig.resume_fingerprint() of the run that wrote it; resume requires a match.",
    )
    data_fingerprint: str | None = Field(
        default=None,
        description="Hash of the packed training samples it was trained on: the saved data position means "
        "the same samples only while this matches (the trainer checks it; the operator cannot).",
    )
    save_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Seconds from the step boundary that began the save to this manifest's writing: the "
        "checkpoint's time to durable, which the operator sizes its pods' drain window by.",
    )
    global_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Sequences per optimizer step it was trained with: a resume at any world size keeps it "
        "unless training.globalBatchSize says otherwise. Absent in checkpoints written before manifests "
        "recorded it (some of those have a global_batch.json beside the shards instead).",
    )


class AttemptInfo(ContractModel):
    """What the operator knows of an attempt and the trainer cannot see: tags of its tracking run."""

    attempt: int | None = None
    image_digest: str | None = None
    trainer_package_sha256: str | None = None


class MlflowRunRef(ContractModel):
    """mlflow.json: the MLflow run a training run logs to, so that every later attempt continues it."""

    tracking_uri: str
    experiment_id: str
    run_id: str
    submission_id: str = Field(description="The submission that created the MLflow run.")


class CheckpointRef(ContractModel):
    uri: str
    step: int
    time: dt.datetime
    save_seconds: float | None = Field(
        default=None,
        description="Seconds from the step boundary that began the save to the checkpoint complete in "
        "storage (its manifest's saveSeconds): what a drain must leave room for.",
    )


class RestartEntry(ContractModel):
    time: dt.datetime
    reason: str
    message: str = ""
    resumed_from_step: int | None = None
    world_size: int | None = Field(
        default=None, description="The training processes of the attempt (or stretch of one) that ended here."
    )


class RunRecord(ContractModel):
    """run.json: what ran, written by the operator next to the checkpoints."""

    schema_version: int = SCHEMA_VERSION
    run_name: str
    namespace: str
    uid: str
    image_requested: str
    image_digest: str | None = None
    trainer_package_sha256: str | None = None
    versions: Versions = Field(default_factory=Versions)
    config: TrainerConfig
    phase: str
    start_time: dt.datetime | None = None
    completion_time: dt.datetime | None = None
    checkpoints: list[CheckpointRef] = Field(default_factory=list)
    restarts: list[RestartEntry] = Field(default_factory=list)
    final_progress: ProgressRecord | None = None
    transport: TransportReport | None = None
    fabric: FabricReport | None = Field(default=None, description="The latest attempt's fabric check.")
    logs_uri: str | None = Field(
        default=None, description="Where the run's logs are: logs/attempt-<n>/rank-<k>.log and driver.log."
    )


class ForensicsRequest(ContractModel):
    """Written by the operator when it declares an attempt hung, before it stops anything: every rank of the
    attempt answers with its RankStacks."""

    attempt: int
    reason: str
    requested_at: dt.datetime


class ThreadStack(ContractModel):
    name: str
    daemon: bool
    stack: str = Field(description="Innermost frame last, as Python's traceback prints it.")


class CollectiveRecord(ContractModel):
    """One collective a rank entered, from torch's flight recorder."""

    seq: int = Field(description="Its number in its process group (collective_seq_id), counting from 1.")
    process_group: str = Field(default="", max_length=128)
    op: str = Field(default="", max_length=128, description="As torch names it, e.g. nccl:all_reduce.")
    completed: bool = Field(
        default=True,
        description="Whether it had completed: one that has not is one the rank (its GPU, on NCCL) waits in.",
    )


class NcclHangDetectorReport(ContractModel):
    """Ray Train's NCCL hang detector (NCCL RAS, Ray >= 2.60) as rank 0 found it when the operator asked:
    whether it ran, and what it stored of a confirmed hang."""

    state: str = Field(
        max_length=128,
        description="observe (the trainer's setting), fail (the run's own), off, or 'unavailable in Ray X'.",
    )
    confirmed: bool = Field(
        default=False, description="It stored the diagnostics of a confirmed hang under the run's prefix."
    )
    uri: str | None = Field(default=None, description="Where: hang_detector/nccl_ras and stack_traces.")
    finding: str = Field(
        default="",
        max_length=2000,
        description="From its last NCCL RAS poll: the communicators whose ranks disagree, the ranks behind.",
    )
    report: str = Field(default="", max_length=8000, description="The end of NCCL RAS's text report.")


class RankStacks(ContractModel):
    """What one rank was doing when the operator asked: every thread's stack and the last lines it logged."""

    rank: int
    world_size: int
    pod: str = Field(description="The host name: the Ray pod on Kubernetes.")
    node: str | None = Field(default=None, description="The Kubernetes node, where the pod is told it.")
    step: int = Field(description="The last optimizer step this rank completed.")
    in_collective: bool = Field(
        description="The training thread (the one running the loop: under Ray Train not the process's main "
        "thread) waits in a torch.distributed call (a collective, a barrier)."
    )
    training_thread_top: str = Field(
        default="", description="The training thread's innermost frame, in one line."
    )
    threads: list[ThreadStack] = Field(default_factory=list)
    recent_log: str = Field(default="", description="The rank's last log lines.")
    collectives: list[CollectiveRecord] = Field(
        default_factory=list,
        description="The last collectives this rank entered, oldest first, from torch's flight recorder "
        "(TORCH_FR_BUFFER_SIZE, which the trainer sets): ranks that entered different numbers of them "
        "show who the others wait for.",
    )
    nccl_hang_detector: NcclHangDetectorReport | None = Field(
        default=None, description="Rank 0's answer only: what Ray Train's NCCL hang detector found."
    )
    written_at: dt.datetime


# ----------------------------------------------------------------------------------------------------------
# Pure helpers both sides use


def split_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key prefix) of an s3:// URI; ValueError for anything else."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3:// URI: {uri!r}")
    return parsed.netloc, parsed.path.lstrip("/")


def run_prefix(storage_path: str, namespace: str, run_name: str) -> str:
    return f"{storage_path.rstrip('/')}/{namespace}/{run_name}"


def attempt_logs_dir(attempt: int) -> str:
    """The logs of one operator attempt, relative to the run's prefix."""
    return f"{LOGS_DIR}/attempt-{attempt}"


def rank_log_name(attempt: int, rank: int) -> str:
    return f"{attempt_logs_dir(attempt)}/rank-{rank}.log"


def driver_log_name(attempt: int) -> str:
    return f"{attempt_logs_dir(attempt)}/{DRIVER_LOG_FILE}"


def forensics_dir(attempt: int) -> str:
    """Hang forensics of one attempt, relative to the run's prefix."""
    return f"{FORENSICS_DIR}/attempt-{attempt}"


def forensics_request_name(attempt: int) -> str:
    return f"{forensics_dir(attempt)}/request.json"


def rank_stacks_name(attempt: int, rank: int) -> str:
    return f"{forensics_dir(attempt)}/rank-{rank}.json"


def timeout_dump_name(dump: str) -> str:
    """Where NCCL's flight-recorder dump from a collective timeout goes under the run's prefix (torch's
    tools/flight_recorder reads it)."""
    return f"{FORENSICS_DIR}/timeout-dumps/{dump}"


def checkpoint_is_complete(manifest: CheckpointManifest | None, listing: dict[str, int]) -> bool:
    """A checkpoint counts only with its manifest, DCP metadata, and every listed file at its listed size.

    `listing` maps file names relative to the checkpoint directory to their sizes, as found in storage.
    """
    if manifest is None or DCP_METADATA_FILE not in listing:
        return False
    return all(listing.get(name) == size for name, size in manifest.files.items())
