"""The per-worker training loop: a plain function of a JSON-able dict, run by Ray Train on every worker, by
torchrun on every process, or by plain `python` as one process."""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch.distributed.fsdp import FSDPModule

from fsdp_trainer import checkpoint, chunked_loss, data, distributed, model, optim, parallelize, transport
from fsdp_trainer.contract import (
    MODEL_DIR,
    Precision,
    SetupStage,
    TrainerConfig,
    Transport,
    TransportReport,
)
from fsdp_trainer.errors import ConfigError, classify
from fsdp_trainer.metrics import flops_per_token
from fsdp_trainer.progress import ProgressWriter, utc_now, versions
from fsdp_trainer.storage import Location
from fsdp_trainer.telemetry import MetricsProcessor, Throughput

log = logging.getLogger(__name__)

FAULT_ENV = "FSDP_TRAINER_FAULT"  # test hook, see Fault


class LoopInput(BaseModel):
    """What the launcher hands every worker."""

    trainer: TrainerConfig
    submission_id: str


def train_loop(config: dict[str, Any]) -> None:
    """Entry point on every worker. `config` is LoopInput as a dict (the TorchTrainer train_loop_config)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop_input = LoopInput.model_validate(config)
    use_gpu = loop_input.trainer.gpus_per_worker > 0
    if use_gpu:
        # The Ray driver sets these for its workers; under torchrun they are set here, before the first
        # collective creates NCCL's communicators (they initialise lazily), unless the launcher set them.
        for key, value in transport.worker_env(
            loop_input.trainer.network, loop_input.trainer.run_name
        ).items():
            os.environ.setdefault(key, value)
    runtime = distributed.start(use_gpu=use_gpu)
    run = Location.parse(loop_input.trainer.run_uri())
    worker = Worker(loop_input, runtime, run)
    try:
        worker.run()
    except BaseException as error:
        # Under Ray the driver records the failure with every worker's error; elsewhere rank 0 does.
        if runtime.launcher != "ray" and runtime.is_main and worker.progress is not None:
            worker.progress.write(
                phase="failed", error=f"{type(error).__name__}: {error}", error_kind=classify(error)
            )
            worker.progress.flush_history()
        raise
    finally:
        if worker.saver is not None:
            worker.saver.close()
        if worker.progress is not None:
            worker.progress.close()
        distributed.stop(runtime)


@dataclass
class Session:
    """Everything one attempt trains with, built by Worker.setup."""

    attempt_id: str
    lm: torch.nn.Module  # the sharded model, called for forward passes
    root: FSDPModule  # the same object seen as the FSDP root (gradient sync control)
    model_config: Any
    tokenizer: Any
    dtype: torch.dtype
    datasets: data.Datasets
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    app_state: checkpoint.AppState
    layout: data.BatchLayout
    throughput: Throughput

    @property
    def state(self) -> checkpoint.TrainState:
        return self.app_state.train


class Worker:
    def __init__(self, loop_input: LoopInput, runtime: distributed.Runtime, run: Location) -> None:
        self.config = loop_input.trainer
        self.submission_id = loop_input.submission_id
        self.runtime = runtime
        self.run_location = run
        self.progress: ProgressWriter | None = None  # rank 0 only
        self.versions = versions()
        self.evaluated_at_step: int | None = None
        self.saver: checkpoint.CheckpointSaver | None = None

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
            config.data, tokenizer, vocab_size, training.sequence_length, training.seed
        )
        log.info("data: %s", datasets.description)

        self.stage(SetupStage.PROBING_TRANSPORT)
        report = self.measure_transport()
        if self.progress is not None:
            self.progress.update(transport=report)

        # Built on the meta device and sharded before it has storage; a resumed run then reads only the
        # checkpoint, a new one initialises or loads each rank's shards directly.
        resume_from = self.choose_checkpoint(datasets.fingerprint)
        self.stage(SetupStage.DOWNLOADING_MODEL)
        lm = model.empty_model(model_config)
        shape = model.model_shape(lm)
        device_type = runtime.device.type
        dtype = parallelize.compute_dtype(Precision(config.fsdp.mixed_precision), device_type)
        mesh = parallelize.build_mesh(
            parallelize.mesh_shape(config.fsdp.sharding, runtime.world_size, runtime.local_world_size),
            device_type,
        )
        root = parallelize.parallelize(lm, config.fsdp, mesh, dtype)
        if training.loss_chunk_tokens:
            chunked_loss.install(lm, training.loss_chunk_tokens)
        if resume_from is not None:
            weights: Literal["initialise", "load", "checkpoint"] = "checkpoint"
        elif config.model.from_config is not None:
            weights = "initialise"
        else:
            weights = "load"
        model.materialise(
            lm,
            runtime.device,
            weights,
            config.model,
            training.seed,
            runtime.rank,
            runtime.local_rank,
            barrier,
            config.fsdp.cpu_offload,
        )
        optimizer = optim.build_optimizer(lm, training)
        scheduler = optim.build_scheduler(optimizer, training)
        app_state = checkpoint.AppState(lm, optimizer, scheduler, checkpoint.TrainState())

        resumed_from = None if resume_from is None else self.resume(app_state, resume_from)
        if self.progress is not None:
            train = app_state.train
            self.progress.update(
                step=train.step, tokens_seen=train.tokens_seen, resumed_from_step=resumed_from
            )
        return Session(
            attempt_id=attempt_id,
            lm=lm,
            root=root,
            model_config=model_config,
            tokenizer=tokenizer,
            dtype=dtype,
            datasets=datasets,
            optimizer=optimizer,
            scheduler=scheduler,
            app_state=app_state,
            layout=data.BatchLayout(
                runtime.world_size, training.micro_batch_size, training.grad_accumulation
            ),
            throughput=Throughput(
                tokens_per_step=runtime.world_size
                * training.micro_batch_size
                * training.grad_accumulation
                * training.sequence_length,
                flops_per_token=flops_per_token(shape, training.sequence_length),
            ),
        )

    def stage(self, stage: SetupStage) -> None:
        if self.progress is not None:
            self.progress.stage(stage)

    def train(self, session: Session) -> None:
        config, runtime, training, state = self.config, self.runtime, self.config.training, session.state
        saver = checkpoint.CheckpointSaver(
            self.run_location,
            checkpoint.SaveIdentity(
                config.run_name,
                self.submission_id,
                config.resume_fingerprint(),
                session.datasets.fingerprint,
                runtime.world_size,
                self.versions,
            ),
            runtime.rank,
            config.checkpoint.keep,
            runtime.device,
        )
        self.saver = saver
        metrics = MetricsProcessor(
            runtime, self.progress, session.throughput, training.log_every, training.max_steps
        )
        fault = Fault.from_env()
        first_step = state.step + 1
        if config.fsdp.compile:  # torch.compile runs in the first step, which can take minutes
            self.stage(SetupStage.COMPILING)
        elif self.progress is not None:
            self.progress.write(phase="training", stage=None)
        session.lm.train()
        for step in range(first_step, training.max_steps + 1):
            if fault is not None and fault.due(runtime.rank, step):
                saver.wait()  # tests know which checkpoint a resume must use: the last one is complete
                fault.trigger()
            learning_rate = float(session.scheduler.get_last_lr()[0])
            loss, grad_norm = self.optimizer_step(session)
            state.step = step
            state.data_position += session.layout.samples_per_step
            state.tokens_seen += session.throughput.tokens_per_step
            if step == first_step and config.fsdp.compile and self.progress is not None:
                self.progress.write(phase="training", stage=None)
            metrics.step_done(step, loss, grad_norm, learning_rate, state.tokens_seen)
            if config.data.eval_every and step % config.data.eval_every == 0:
                metrics.exclude(self.evaluate(session))
            if step % config.checkpoint.every_steps == 0 or step == training.max_steps:
                name = checkpoint.checkpoint_name(step, session.attempt_id)
                blocked = saver.start(session.app_state, name, metrics.last_loss)
                log.info("checkpoint step %d: training blocked %.3f s", step, blocked)
                metrics.exclude(blocked)
                if self.progress is not None:
                    self.progress.update(checkpoint_blocked_seconds=blocked)
                    self.progress.flush_history()

    def optimizer_step(self, session: Session) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accumulation micro-batches; returns this rank's loss and the gradient
        norm before clipping, as device tensors (reading them is the metrics processor's host sync)."""
        training, device, state = self.config.training, self.runtime.device, session.state
        micro_batches = (  # read one at a time, as each micro-step begins
            session.datasets.train.samples(
                session.layout.micro_batch_indices(state.data_position, micro_step, self.runtime.rank)
            ).to(device)
            for micro_step in range(training.grad_accumulation)
        )
        loss_sum = optim.accumulate_gradients(
            session.lm,
            session.root,
            micro_batches,
            training.grad_accumulation,
            self.config.fsdp.reduce_every_micro_step,
        )
        grad_norm = optim.clip_gradients(session.lm.parameters(), training.max_grad_norm)
        session.optimizer.step()
        session.scheduler.step()
        session.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def finish(self, session: Session) -> None:
        if self.saver is not None:
            self.saver.wait()  # the last checkpoint is complete before the run says it finished
        if self.evaluated_at_step != session.state.step:
            self.evaluate(session)
        exported = None
        if self.config.checkpoint.export_model:
            exported = self.export(session)
        if self.progress is not None:
            self.progress.write(phase="finished", step=session.state.step, exported_model_uri=exported)
            self.progress.flush_history()

    # ------------------------------------------------------------------------------------------------------
    def measure_transport(self) -> TransportReport:
        """Bus bandwidth from a short all-reduce, then (under NCCL) the network every rank's NCCL log shows;
        the probe also makes NCCL initialise, so its log exists afterwards."""
        runtime, network = self.runtime, self.config.network
        bandwidth = (
            _probe_bandwidth(network.bandwidth_probe_mb, runtime.device) if runtime.world_size > 1 else None
        )
        if runtime.backend != "nccl":
            return TransportReport(
                observed=Transport.GLOO,
                evidence=[f"torch.distributed backend {runtime.backend} on {runtime.device.type}"],
                bus_bandwidth_gbps=bandwidth,
            )
        mine = transport.parse_nccl_log(transport.own_nccl_log_lines(self.config.run_name))
        gathered = distributed.all_gather((os.uname().nodename, mine))
        nodes = len({host for host, _ in gathered})
        report = transport.combine([rank_report for _, rank_report in gathered], nodes)
        report.bus_bandwidth_gbps = bandwidth
        if mine.nccl_version:
            self.versions.nccl = mine.nccl_version
        log.info("transport: %s over %d node(s), bus bandwidth %s GB/s", report.observed, nodes, bandwidth)
        transport.enforce(network.efa, report)
        return report

    def choose_checkpoint(self, data_fingerprint: str) -> Location | None:
        """The checkpoint to resume from (rank 0 looks, every rank learns the answer), or None."""
        config, runtime = self.config, self.runtime
        chosen: str | None = None
        refusal: str | None = None
        if runtime.is_main:
            try:
                found = checkpoint.find_resume_point(
                    self.run_location,
                    config.checkpoint.resume,
                    self.submission_id,
                    config.resume_fingerprint(),
                    data_fingerprint,
                )
                chosen = None if found is None else found.location.uri
            except ConfigError as error:
                refusal = str(error)
        # Every rank must leave this together: rank 0's refusal fails them all, none waits for a collective.
        chosen, refusal = distributed.broadcast((chosen, refusal))
        if refusal is not None:
            raise ConfigError(refusal)
        if chosen is None:
            log.info("starting from scratch")
            return None
        return Location.parse(chosen)

    def resume(self, app_state: checkpoint.AppState, chosen: Location) -> int:
        config, runtime = self.config, self.runtime
        self.stage(SetupStage.LOADING_CHECKPOINT)
        reseed = config.training.seed * 100_003 + runtime.rank
        had_rng = checkpoint.load(chosen, app_state, runtime.rank, runtime.local_rank, reseed, dist.barrier)
        if not had_rng:
            log.warning(
                "checkpoint has no RNG state for rank %d (saved on fewer workers): reseeded", runtime.rank
            )
        log.info("resumed from %s at step %d", chosen.uri, app_state.train.step)
        return app_state.train.step

    def evaluate(self, session: Session) -> float:
        """Held-out loss and perplexity, averaged over ranks (nothing to do without held-out data); returns
        the seconds it took."""
        samples, lm, runtime = session.datasets.eval, session.lm, self.runtime
        if samples is None:
            return 0.0
        started = time.perf_counter()
        self.evaluated_at_step = session.state.step
        batches = data.eval_batch_indices(
            len(samples),
            self.config.data.eval_batches,
            self.config.training.micro_batch_size,
            runtime.rank,
            runtime.world_size,
        )
        lm.eval()
        total = torch.zeros((), device=runtime.device)
        with torch.no_grad():
            for indices in batches:
                batch = samples.samples(indices).to(runtime.device)
                total += lm(input_ids=batch, labels=batch).loss
        lm.train()
        eval_loss = distributed.mean(float(total) / len(batches), runtime.device)
        perplexity = math.exp(min(eval_loss, 80.0))  # capped: an untrained model would overflow
        if self.progress is not None:
            log.info("eval loss %.4f perplexity %.2f", eval_loss, perplexity)
            self.progress.update(eval_loss=eval_loss, eval_perplexity=perplexity)
        return time.perf_counter() - started

    def export(self, session: Session) -> str:
        """A consolidated Hugging Face model (safetensors) at <storage>/<run>/model/: the full state dict is
        gathered to rank 0's CPU only, then saved through a weightless copy of the architecture."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from fsdp_trainer.model import AutoModelForCausalLM

        dtype = session.dtype
        full_state = get_model_state_dict(
            session.lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        destination = self.run_location.child(MODEL_DIR)
        if self.runtime.is_main:
            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(session.model_config, dtype=dtype)
            weights = {k: v.to(dtype) for k, v in full_state.items() if isinstance(v, torch.Tensor)}
            shell.load_state_dict(weights, assign=True)
            shell.tie_weights()
            with tempfile.TemporaryDirectory(prefix="fsdp-export-") as local_dir:
                shell.save_pretrained(local_dir)
                if session.tokenizer is not None:
                    session.tokenizer.save_pretrained(local_dir)
                destination.replace_with(local_dir)
            log.info("exported the model to %s", destination.uri)
        dist.barrier()
        return destination.uri


# ----------------------------------------------------------------------------------------------------------


def _probe_bandwidth(size_mb: int, device: torch.device, iterations: int = 5) -> float | None:
    if size_mb <= 0:
        return None
    buffer = torch.ones(size_mb * 1024 * 1024 // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buffer)  # warm-up: connection setup is not bandwidth
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(buffer)
    _synchronize(device)
    seconds = (time.perf_counter() - start) / iterations
    # Ranks finish at slightly different times; the slowest defines the collective's duration.
    seconds = distributed.maximum(seconds, device)
    return transport.bus_bandwidth_gbps(buffer.numel() * 4, dist.get_world_size(), seconds)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
