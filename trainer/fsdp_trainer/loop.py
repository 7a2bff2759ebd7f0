"""The per-worker training loop: a plain function of a JSON-able dict, run by Ray Train on every worker, by
torchrun on every process, or by plain `python` as one process.

The Trainer builds the parts (model, optimizer, scheduler, the batch loader, the validator, the checkpoint
manager, the metrics processor) and runs the loop over them; each part lives in its own module."""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fsdp_trainer import (
    adapter,
    checkpoint,
    data,
    distributed,
    fabric,
    forensics,
    model,
    optim,
    runlog,
    transport,
)
from fsdp_trainer.checkpoint_manager import CheckpointManager
from fsdp_trainer.contract import NODE_NAME_ENV, SetupStage, TrainingData
from fsdp_trainer.errors import ConfigError, ModelError, NonFiniteLossError, classify
from fsdp_trainer.formats import RowCounts
from fsdp_trainer.launch import LoopInput
from fsdp_trainer.metrics import flops_per_token
from fsdp_trainer.preemption import DrainWatch
from fsdp_trainer.progress import ProgressWriter, utc_now, versions
from fsdp_trainer.sharded_model import build_sharded_model
from fsdp_trainer.storage import Location
from fsdp_trainer.telemetry import MetricsProcessor, Throughput
from fsdp_trainer.tracking import MlflowTracker, start_tracking
from fsdp_trainer.validate import Validator

log = logging.getLogger(__name__)

FAULT_ENV = "FSDP_TRAINER_FAULT"  # test hook, see Fault


def train_loop(config: dict[str, Any]) -> None:
    """Entry point on every worker. `config` is LoopInput as a dict (the TorchTrainer train_loop_config)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop_input = LoopInput.model_validate(config)
    use_gpu = loop_input.trainer.gpus_per_worker > 0
    socket_interface = None
    if use_gpu:
        # The Ray driver sets these for its workers; under torchrun they are set here, before the first
        # collective creates NCCL's communicators (they initialise lazily), unless the launcher set them.
        for key, value in transport.worker_env(
            loop_input.trainer.network, loop_input.trainer.run_name
        ).items():
            os.environ.setdefault(key, value)
        os.environ.update(transport.allocator_env())  # before distributed.start initialises CUDA
        socket_interface = transport.choose_socket_interface()  # on the worker: its own pod's interfaces
    os.environ.update(forensics.flight_recorder_env())  # before the group starts (Ray's: the driver sets it)
    runtime = distributed.start(use_gpu=use_gpu, cpu_offload=loop_input.trainer.fsdp.cpu_offload)
    run = Location.parse(loop_input.trainer.run_uri())
    rank_log = runlog.start_rank_log(
        run, loop_input.attempt.attempt or 1, runtime.rank, loop_input.trainer.secret_env_names
    )
    trainer = Trainer(loop_input, runtime, run, socket_interface)
    watch = forensics.ForensicsWatch(
        run,
        loop_input.attempt.attempt or 1,
        runtime.rank,
        runtime.world_size,
        step=lambda: trainer.step,
        recent_log=rank_log.recent,
        relay=forensics.RayRelay(run, loop_input.attempt.attempt or 1) if runtime.launcher == "ray" else None,
    )
    tracking_status = "FAILED"
    try:
        trainer.run()
        tracking_status = "FINISHED"
    except BaseException as error:
        log.exception("rank %d failed", runtime.rank)
        # Under Ray the driver records the failure with every worker's error; elsewhere rank 0 does.
        if runtime.launcher != "ray" and runtime.is_main and trainer.progress is not None:
            trainer.progress.write(
                phase="failed", error=f"{type(error).__name__}: {error}", error_kind=classify(error)
            )
            trainer.progress.flush_history()
        raise
    finally:
        try:
            if trainer.checkpoints is not None:
                trainer.checkpoints.close()
            if trainer.progress is not None:
                trainer.progress.close()
            if trainer.tracker is not None:
                trainer.tracker.close(tracking_status)
            distributed.stop(runtime)
        finally:
            watch.stop()
            runlog.stop_rank_log(rank_log)  # last: it keeps what closing the rest logged


@dataclass
class Session:
    """Everything one attempt trains with, built by Trainer.setup."""

    attempt_id: str
    lm: torch.nn.Module  # the sharded model, called for forward passes
    root: FSDPModule  # the same object seen as the FSDP root (gradient sync control)
    mesh: DeviceMesh  # of the sharding
    model_config: Any
    tokenizer: Any
    dtype: torch.dtype
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    batches: data.BatchLoader
    validator: Validator
    app_state: checkpoint.AppState
    checkpoints: CheckpointManager
    metrics: MetricsProcessor

    @property
    def state(self) -> checkpoint.TrainState:
        return self.app_state.train


class Trainer:
    """One attempt on one worker: `setup` builds the parts, `train` runs the loop, `finish` completes the
    run (last checkpoint, final evaluation, export, the finished record)."""

    def __init__(
        self,
        loop_input: LoopInput,
        runtime: distributed.Runtime,
        run: Location,
        socket_interface: str | None = None,
    ) -> None:
        self.config = loop_input.trainer
        self.socket_interface = socket_interface
        self.submission_id = loop_input.submission_id
        self.attempt = loop_input.attempt
        self.runtime = runtime
        self.run_location = run
        self.progress: ProgressWriter | None = None  # rank 0 only
        self.versions = versions()
        self.checkpoints: CheckpointManager | None = None  # closed by train_loop, however setup ends
        self.tracker: MlflowTracker | None = None  # rank 0 only, closed by train_loop
        self.step = 0  # the last step this rank completed (hang forensics report it)
        self.row_counts: Callable[[], RowCounts] = RowCounts  # the data's, once setup has built it
        self.skipped_in_a_row = 0  # steps whose update was skipped, up to the last settled one

    def run(self) -> None:
        session = self.setup()
        self.train(session)
        self.finish(session)

    # ------------------------------------------------------------------------------------------------------
    def setup(self) -> Session:
        config, runtime, training = self.config, self.runtime, self.config.training
        attempt_id = distributed.broadcast(utc_now().strftime("%Y%m%dT%H%M%S%f"))
        if runtime.is_main:
            self.progress = ProgressWriter(
                self.run_location,
                attempt_id,
                run_name=config.run_name,
                submission_id=self.submission_id,
                phase="starting",
                max_steps=training.max_steps,
                world_size=runtime.world_size,
                versions=self.versions,
            )
        self.stage(SetupStage.INITIALIZING)
        log.info("rank %d/%d (%s) on %s", runtime.rank, runtime.world_size, runtime.launcher, runtime.device)

        barrier = dist.barrier
        self.stage(SetupStage.DOWNLOADING_MODEL)
        tokenizer = model.load_tokenizer(config.model, runtime.local_rank, barrier)
        model_config = model.model_config(config.model, runtime.local_rank, barrier)
        vocab_size = int(model_config.vocab_size)
        if tokenizer is not None and len(tokenizer) > vocab_size:
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model only {vocab_size}")
        self.stage(SetupStage.LOADING_DATA)
        datasets = data.build_datasets(
            config.data,
            tokenizer,
            vocab_size,
            training.sequence_length,
            training.seed,
            streams=runtime.world_size * training.micro_batch_size,
            list_source=data.shared_source_shards,
        )
        log.info("data: %s", datasets.description)
        validator = Validator(datasets.eval, config.data.eval_batches, training.micro_batch_size, runtime)
        self.row_counts = datasets.row_counts
        self.report_training_data()

        self.stage(SetupStage.PROBING_TRANSPORT)
        fabric_report, transport_report = fabric.check(
            config.network,
            config.run_name,
            runtime,
            self.versions,
            self.socket_interface,
            node=os.environ.get(NODE_NAME_ENV),
        )
        if self.progress is not None:
            self.progress.update(transport=transport_report, fabric=fabric_report)
            if not fabric_report.passed:  # stored before the error ends the attempt: the operator acts on it
                self.progress.write()
        fabric.raise_if_failed(fabric_report)

        checkpoints = CheckpointManager(
            config, self.submission_id, runtime, self.run_location, datasets.fingerprint, self.versions
        )
        self.checkpoints = checkpoints
        if runtime.is_main:  # it finds or creates its MLflow run while the model is built
            self.tracker = start_tracking(
                config, self.attempt, self.submission_id, self.run_location, datasets.fingerprint
            )
        resume_from = checkpoints.find()
        layout = self.batch_layout(resume_from)
        self.stage(SetupStage.DOWNLOADING_MODEL)
        if resume_from is not None:
            weights: model.Weights = "checkpoint"
        elif config.model.from_config is not None:
            weights = "initialise"
        else:
            weights = "load"
        sharded = build_sharded_model(config, model_config, runtime, weights)
        lm = sharded.lm
        if config.fsdp.adapter is not None:
            log.info("adapter: %s", adapter.describe(lm))
            if self.progress is not None:
                self.progress.update(adapter_bytes=adapter.trainable_bytes(lm))
        # Each rank's own stream from the run's seed, whatever setup drew before (the initialisation draws the
        # same stream on every rank on CUDA, a loaded model none): dropout is reproducible and differs between
        # ranks. A resumed run then continues the checkpoint's streams.
        checkpoint.seed_generators(checkpoint.rank_seed(training.seed, runtime.rank))
        optimizer = optim.build_optimizer(lm, training)
        scheduler = optim.build_scheduler(optimizer, training)
        batches = data.BatchLoader(datasets.train, layout, runtime.rank, runtime.device)
        app_state = checkpoint.AppState(lm, optimizer, scheduler, checkpoint.TrainState(), batches)

        resumed_from = None
        if resume_from is not None:
            self.stage(SetupStage.LOADING_CHECKPOINT)
            resumed_from = checkpoints.load(app_state, resume_from)
        if self.progress is not None:
            train = app_state.train
            self.progress.update(
                step=train.step, tokens_seen=train.tokens_seen, resumed_from_step=resumed_from
            )
        throughput = Throughput(
            tokens_per_step=layout.samples_per_step * training.sequence_length,
            flops_per_token=flops_per_token(sharded.shape, training.sequence_length),
        )
        return Session(
            attempt_id=attempt_id,
            lm=lm,
            root=sharded.root,
            mesh=sharded.mesh,
            model_config=model_config,
            tokenizer=tokenizer,
            dtype=sharded.dtype,
            optimizer=optimizer,
            scheduler=scheduler,
            batches=batches,
            validator=validator,
            app_state=app_state,
            checkpoints=checkpoints,
            metrics=MetricsProcessor(
                runtime,
                self.progress,
                throughput,
                training.log_every,
                training.max_steps,
                tracker=self.tracker,
            ),
        )

    def batch_layout(self, resume_from: Location | None) -> data.BatchLayout:
        """This attempt's layout: the global batch is the recipe's (training.globalBatchSize) or, unset, the
        one the resumed checkpoint records (checkpoint.resumed_global_batch), so a resume at any world size
        keeps tokens per step, the schedule and the data position."""
        runtime, training = self.runtime, self.config.training
        checkpoint_global_batch: int | None = None
        if resume_from is not None and training.global_batch_size is None:
            found: int | None = None
            refusal: str | None = None
            if runtime.is_main:
                unrecorded = runtime.world_size * training.micro_batch_size * training.grad_accumulation
                try:
                    found = checkpoint.resumed_global_batch(resume_from, training.sequence_length, unrecorded)
                except ConfigError as error:
                    refusal = str(error)
            # Every rank leaves together: rank 0's refusal fails them all.
            checkpoint_global_batch, refusal = distributed.broadcast((found, refusal))
            if refusal is not None:
                raise ConfigError(refusal)
        try:
            accumulation = training.accumulation_for(runtime.world_size, checkpoint_global_batch)
        except ValueError as error:
            raise ConfigError(str(error)) from error
        return data.BatchLayout(runtime.world_size, training.micro_batch_size, accumulation)

    def report_training_data(self) -> None:
        """Rank 0's record of the data format, the learned tokens and the rows left out or cut so far."""
        if self.progress is None:
            return
        spec, counts = self.config.data, self.row_counts()
        self.progress.update(
            training_data=TrainingData(
                format=spec.format,
                learned=spec.learned_tokens(),
                packed=spec.packing,
                rows=counts.rows,
                unparsable=counts.unparsable,
                truncated=counts.truncated,
                dropped=counts.dropped,
            )
        )

    def stage(self, stage: SetupStage) -> None:
        if self.progress is not None:
            self.progress.stage(stage)

    def train(self, session: Session) -> None:
        config, runtime, training, state = self.config, self.runtime, self.config.training, session.state
        checkpoints, metrics = session.checkpoints, session.metrics
        fault = Fault.from_env()
        drain = DrainWatch.for_launcher(runtime.launcher)
        first_step = state.step + 1
        self.skipped_in_a_row = 0
        # A checkpoint due at a skipped step is saved after the next applied one (if any): every checkpoint
        # holds the state after a step whose loss was finite, never weights that came in non-finite.
        save_pending = False
        # The previous step's skip decision, read by the host only once the next step's forward and backward
        # are queued (see StepOutcome), unless a log or checkpoint step needed it at once.
        unsettled: StepOutcome | None = None
        if config.fsdp.compile:  # torch.compile runs in the first step, which can take minutes
            self.stage(SetupStage.COMPILING)
        else:
            metrics.training_started()
        session.lm.train()
        with collector_skips_setup():
            for step in range(first_step, training.max_steps + 1):
                if fault is not None and fault.due(runtime.rank, step):
                    checkpoints.wait()  # tests know which checkpoint a resume uses: the last is complete
                    fault.trigger()
                try:
                    loss, grad_norm, skip = self.forward_backward(session)
                except torch._dynamo.exc.Unsupported as error:  # evaluated only when something is raised
                    raise ModelError(
                        "fsdp.compile: torch.compile cannot compile a decoder layer whole (fullgraph=True): "
                        f"{error}. Turn fsdp.compile off for this model."
                    ) from error
                if unsettled is not None:
                    self.settle(session, unsettled)
                    unsettled = None
                learning_rate = float(session.scheduler.get_last_lr()[0])
                self.update(session, skip)
                self.step = step
                # A skipped step still takes its step number: its samples were read, so the step, the data
                # position and tokens seen move on together, the batch that went non-finite is not retried,
                # and maxSteps still bounds the attempt.
                state.step = step
                state.tokens_seen += metrics.throughput.tokens_per_step
                outcome = StepOutcome.start(step, loss, skip)
                save_pending = drain.noticed() or save_pending or checkpoints.due(step)
                applied = None
                if save_pending or metrics.due(step):  # the last step is a logging step
                    applied = self.settle(session, outcome)
                else:
                    unsettled = outcome
                if step == first_step:
                    if config.fsdp.compile:
                        metrics.training_started()
                    self.collective_timeout(session, distributed.STEP_TIMEOUT)
                metrics.step_done(step, loss, grad_norm, learning_rate, state.tokens_seen)
                if config.data.eval_every and step % config.data.eval_every == 0:
                    metrics.evaluated(session.validator.validate(session.lm, step), step)
                if save_pending and applied:
                    checkpoints.save(
                        session.app_state,
                        session.attempt_id,
                        metrics.last_loss,
                        session.batches.layout.samples_per_step,
                    )
                    save_pending = False
                    if drain.pending:  # durable before the node goes; no step after it until then
                        self.checkpoint_staged(session)
                        metrics.exclude(drain.checkpointed(checkpoints, self.progress, step))

    def forward_backward(self, session: Session) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward and backward passes of one optimizer step over grad_accumulation micro-batches; returns
        the step's loss, the gradient norm before clipping and whether to skip the update (1.0: the loss or
        the norm is not finite), all three device tensors, the same on every rank. Queued without a host
        sync: reading them is the metrics processor's and StepOutcome's."""
        # All of the step's micro-batches first: the loss is divided by their target count.
        micro_batches = list(session.batches.next_step())
        loss_share = optim.accumulate_gradients(
            session.lm, session.root, micro_batches, self.config.fsdp.reduce_every_micro_step
        )
        grad_norm = optim.clip_gradients(session.lm.parameters(), self.config.training.max_grad_norm)
        loss = optim.global_loss(loss_share)
        return loss, grad_norm, optim.non_finite(loss, grad_norm)

    def update(self, session: Session, skip: torch.Tensor) -> None:
        """The optimizer step, skipped on the device where `skip` is 1 (its gradients dropped either way)."""
        self.checkpoint_staged(session)  # a save's staging overlapped this step's forward and backward
        optim.apply_update(session.optimizer, skip)
        session.optimizer.zero_grad(set_to_none=True)

    def settle(self, session: Session, outcome: StepOutcome) -> bool:
        """The host's part of a step once its skip decision is read: the schedule counts applied updates (a
        skipped step leaves the learning rate as it was, so skipped steps never cut the warmup short; the
        decay then ends just above its floor), skipped steps are counted, and maxNonFiniteSteps of them in
        a row fail the attempt. Returns whether the update was applied."""
        if outcome.applied():
            self.skipped_in_a_row = 0
            session.scheduler.step()
            return True
        self.skipped_in_a_row += 1
        session.metrics.step_skipped(outcome.step, outcome.loss)
        if self.skipped_in_a_row == self.config.training.max_non_finite_steps:
            self.fail_non_finite(session.checkpoints, outcome.step)
        return False

    def fail_non_finite(self, checkpoints: CheckpointManager, step: int) -> NoReturn:
        """Fails the attempt at the last of maxNonFiniteSteps skipped steps in a row. Every rank gets here at
        the same step, so the save in flight (of the last applied step) can complete first."""
        limit = self.config.training.max_non_finite_steps
        error = NonFiniteLossError(
            f"step {step}: the loss or gradient norm was not finite for {limit} steps in a row (steps "
            f"{step - limit + 1}-{step}, training.maxNonFiniteSteps {limit}); none of their updates was "
            "applied. Lower the learning rate or check the data of these steps."
        )
        try:
            checkpoints.wait()
        except OSError as save_failure:  # the failure to report is still the non-finite steps
            raise error from save_failure
        raise error

    def checkpoint_staged(self, session: Session) -> None:
        """Waits for a save's staging (if one is in flight) and records how long it held training up."""
        blocked = session.checkpoints.staging_done()
        if blocked is not None:
            session.metrics.checkpoint_staged(blocked)

    def collective_timeout(self, session: Session, timeout: dt.timedelta) -> None:
        distributed.set_collective_timeout(timeout, session.mesh.get_all_groups())
        log.info("collectives time out after %s", timeout)

    def finish(self, session: Session) -> None:
        checkpoints, step = session.checkpoints, session.state.step
        self.collective_timeout(session, distributed.SETUP_TIMEOUT)  # export: ranks wait on uploads
        self.checkpoint_staged(session)
        checkpoints.wait()  # the last checkpoint is complete before the run says it finished
        if session.validator.evaluated_at_step != step:
            session.metrics.evaluated(session.validator.validate(session.lm, step), step)
        self.report_training_data()
        exported = None
        if self.config.checkpoint.export_model:
            exported = checkpoints.export(session.lm, session.model_config, session.tokenizer, session.dtype)
            if self.tracker is not None:
                self.tracker.log_model(Location.parse(exported))
        session.metrics.finished(step, exported)


@dataclass(frozen=True)
class StepOutcome:
    """A step's skip decision on its way to the host. On CUDA it is copied into pinned memory without
    blocking, and the host waits on that copy's event only: reading the flag at once would wait for the
    whole step (every queued kernel) and leave the GPU idle while the host queues the next one; read after
    the next step's forward and backward are queued, it was computed long before and the GPU stays busy."""

    step: int
    loss: torch.Tensor
    skip: torch.Tensor  # in host memory once `copied` has completed
    copied: torch.cuda.Event | None

    @classmethod
    def start(cls, step: int, loss: torch.Tensor, skip: torch.Tensor) -> StepOutcome:
        if skip.device.type != "cuda":
            return cls(step, loss, skip, None)
        host = torch.empty(skip.shape, dtype=skip.dtype, pin_memory=True)
        host.copy_(skip, non_blocking=True)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record()
        return cls(step, loss, host, copied)

    def applied(self) -> bool:
        if self.copied is not None:
            self.copied.synchronize()
        return not bool(self.skip)


@contextlib.contextmanager
def collector_skips_setup() -> Iterator[None]:
    """Moves every object alive after setup out of the cyclic collector's reach for the loop's duration.

    A full collection walks every tracked object with the GIL held: after setup that is ~500K objects of
    torch, transformers and (under Ray) Ray itself, 0.18-0.24 s on a CPU core, and the rank it hits stalls
    every other rank at the next collective. Training creates few long-lived objects, so with the setup's
    frozen a full collection walks only those (measured: a 300-step Ray run went from one 0.24 s pause to
    none). Objects are handed back to the collector when the loop ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """Test hook (FSDP_TRAINER_FAULT="rank=R,step=S[,marker=PATH][,action=exit|hang]"): at step S rank R
    dies (exit) or stops making progress while its process stays alive (hang), after the checkpoint save in
    flight (if any) is complete. With a marker file, once (the file records it); without, in every attempt."""

    rank: int
    step: int
    marker: str | None
    action: Literal["exit", "hang"] = "exit"

    @classmethod
    def from_env(cls) -> Fault | None:
        spec = os.environ.get(FAULT_ENV)
        if not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(","))
        action = fields.get("action", "exit")
        if action not in ("exit", "hang"):
            raise ValueError(f"{FAULT_ENV}: action must be exit or hang, not {action!r}")
        marker = fields.get("marker")
        return cls(int(fields["rank"]), int(fields["step"]), marker, "hang" if action == "hang" else "exit")

    def due(self, rank: int, step: int) -> bool:
        once_done = self.marker is not None and os.path.exists(self.marker)
        return rank == self.rank and step == self.step and not once_done

    def trigger(self) -> None:
        """Dies like a lost worker (no exception, no cleanup), or hangs like a stuck collective."""
        if self.marker is not None:
            with open(self.marker, "w") as marker:
                marker.write(f"{dt.datetime.now(dt.UTC).isoformat()} step {self.step} {self.action}\n")
        log.error("fault injection: %s at step %d", self.action, self.step)
        if self.action == "hang":
            while True:
                time.sleep(3600)
        logging.shutdown()
        os._exit(17)
