"""The checkpoint manager: finds the checkpoint a run resumes from, loads it, saves asynchronously (the saver
finalises each checkpoint with its manifest and prunes old ones), and exports the trained model
(export.py)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from fsdp_trainer import adapter, checkpoint, distributed
from fsdp_trainer.contract import MODEL_DIR, TrainerConfig, Versions
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.export import export_model
from fsdp_trainer.storage import Location

log = logging.getLogger(__name__)


class CheckpointManager:
    """Every rank builds one at the same point (the saver's process group is created collectively)."""

    def __init__(
        self,
        config: TrainerConfig,
        submission_id: str,
        runtime: distributed.Runtime,
        run: Location,
        data_fingerprint: str,
        versions: Versions,
    ) -> None:
        self.config, self.submission_id, self.runtime, self.run = config, submission_id, runtime, run
        self.data_fingerprint = data_fingerprint
        self.saver = checkpoint.CheckpointSaver(
            run,
            checkpoint.SaveIdentity(
                config.run_name,
                submission_id,
                config.resume_fingerprint(),
                data_fingerprint,
                runtime.world_size,
                versions,
            ),
            runtime.rank,
            config.checkpoint.keep,
            runtime.device,
            ranks_per_node=runtime.local_world_size,
        )
        self._saving_step: int | None = None  # the step of a save whose staging is not yet waited for
        self._blocked = 0.0

    def find(self) -> Location | None:
        """The checkpoint to resume from (rank 0 looks, every rank learns the answer), or None."""
        chosen: str | None = None
        refusal: str | None = None
        if self.runtime.is_main:
            try:
                found = checkpoint.find_resume_point(
                    self.run,
                    self.config.checkpoint.resume,
                    self.submission_id,
                    self.config.resume_fingerprint(),
                    self.data_fingerprint,
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

    def load(self, app_state: checkpoint.AppState, chosen: Location) -> int:
        """Loads `chosen` into the state; returns the step it was saved at."""
        runtime = self.runtime
        reseed = checkpoint.rank_seed(self.config.training.seed, runtime.rank)
        loaded = checkpoint.load(chosen, app_state, runtime.rank, reseed)
        if not loaded.rng_restored:
            log.warning(
                "checkpoint has no RNG state for rank %d (saved on fewer workers): reseeded", runtime.rank
            )
        log.info("resumed from %s at step %d", chosen.uri, app_state.train.step)
        return app_state.train.step

    def due(self, step: int) -> bool:
        return step % self.config.checkpoint.every_steps == 0 or step == self.config.training.max_steps

    def save(
        self, app_state: checkpoint.AppState, attempt_id: str, loss: float | None, global_batch: int
    ) -> None:
        """Starts saving the current state, trained with `global_batch` sequences per step; its staging runs
        on while the next step's forward and backward do, until `staging_done`."""
        step = app_state.train.step
        self._saving_step = step
        name = checkpoint.checkpoint_name(step, attempt_id)
        self._blocked = self.saver.start(app_state, name, loss, global_batch)

    def staging_done(self) -> float | None:
        """Waits until the save in flight (if any) has staged the state, before the weights change; returns
        the seconds that save held training up (starting it and waiting here), once per save, else None."""
        if self._saving_step is None:
            return None
        blocked = self._blocked + self.saver.wait_for_staging()
        log.info("checkpoint step %d: training blocked %.3f s", self._saving_step, blocked)
        self._saving_step = None
        return blocked

    def wait(self) -> None:
        """Finishes the save in flight: afterwards the last checkpoint is complete, on every rank."""
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()

    def export(self, lm: torch.nn.Module, model_config: Any, tokenizer: Any, dtype: torch.dtype) -> str:
        """A Hugging Face model (safetensors) at <storage>/<run>/model/, written by every rank, each holding
        one full tensor at a time (export.py). With an adapter: the adapter under <run>/adapter/ (its URI is
        returned) and, with exportMerged, the base model with the adapter merged into it under model/."""
        runtime, lora = self.runtime, self.config.fsdp.adapter
        if lora is not None:
            adapter_uri = adapter.export_adapter(lm, lora, self.config.model.source, self.run, runtime.rank)
            log.info("export: the adapter (%d bytes) to %s", adapter.trainable_bytes(lm), adapter_uri)
            if not lora.export_merged:
                return adapter_uri
        destination = self.run.child(MODEL_DIR)
        exported = export_model(
            lm,
            model_config,
            tokenizer,
            dtype,
            destination,
            runtime.rank,
            runtime.world_size,
            state=None if lora is None else adapter.merged_state(lm, lora),
        )
        log.info(
            "export: rank %d wrote %d weight files, holding at most %d bytes of the model at once (of %d)",
            runtime.rank,
            len(exported.files),
            exported.peak_tensor_bytes,
            exported.total_bytes,
        )
        return destination.uri if lora is None else adapter_uri
