"""The checkpoint manager: finds the checkpoint a run resumes from, loads it, saves asynchronously (the saver
finalises each checkpoint with its manifest and prunes old ones), and exports the trained model."""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from fsdp_trainer import checkpoint, distributed
from fsdp_trainer.contract import MODEL_DIR, TrainerConfig, Versions
from fsdp_trainer.errors import ConfigError
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
        """A consolidated Hugging Face model (safetensors) at <storage>/<run>/model/: the full state dict is
        gathered to rank 0's CPU only, then saved through a weightless copy of the architecture."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from fsdp_trainer.model import AutoModelForCausalLM

        full_state = get_model_state_dict(
            lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        destination = self.run.child(MODEL_DIR)
        if self.runtime.is_main:
            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
            weights = {k: v.to(dtype) for k, v in full_state.items() if isinstance(v, torch.Tensor)}
            shell.load_state_dict(weights, assign=True)
            shell.tie_weights()
            with tempfile.TemporaryDirectory(prefix="fsdp-export-") as local_dir:
                shell.save_pretrained(local_dir)
                if tokenizer is not None:
                    tokenizer.save_pretrained(local_dir)
                destination.replace_with(local_dir)
            log.info("exported the model to %s", destination.uri)
        dist.barrier()
        return destination.uri
