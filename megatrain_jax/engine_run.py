"""``EngineRun``: what a run over the streamed engine answers the same way whichever groups it trains (every weight:
``trainer.StreamedRun``; adapters over a frozen base: ``lora_trainer.LoraRun``): the step in whole micro-batches,
the count, the device whose memory is reported, where checkpoints are written, closing. Each run adds what depends
on its trained groups (weights, checkpoints, plan, export, learning rate)."""
from __future__ import annotations

from typing import Any

import jax

from megatrain_jax.engine.step import StepResult, as_batch
from megatrain_jax.errors import UserError


class EngineRun:
    """The part of ``trainer_protocol.TrainerProtocol`` a run answers through its ``engine`` alone."""

    engine: Any  # the streamed engine (engine/step.StreamedTrainer, or its LoRA variant)

    @property
    def step_count(self) -> int:
        """Optimizer updates applied so far."""
        return self.engine.count

    @property
    def memory_device(self) -> jax.Device | None:
        """The device whose memory ``memory.memory_snapshot`` reports (None: compute on the host's CPU)."""
        return self.engine.device if self.engine.xfer.on_gpu else None

    @property
    def sharded_checkpoints(self) -> bool:
        """Every process writes its own shares of a checkpoint (``train.host_state=sharded``)."""
        return self.engine.options.host_state_place.sharded

    def step(self, batch: Any) -> StepResult:
        """One optimizer step; ``StepResult(loss, grad_norm, tokens, skipped)``."""
        b = as_batch(batch)
        m = self.engine.options.micro_batches
        if b.tokens.shape[0] % m:
            raise UserError("batch", f"{b.tokens.shape[0]} sequences do not split into {m} micro-batches",
                            "use a batch size divisible by micro_batches")
        return self.engine.step(b)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "EngineRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
