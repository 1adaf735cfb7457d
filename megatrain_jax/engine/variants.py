"""LoRA or full training: the engine's one dispatch between its two variants.

The choice is made once, by ``plan.lora.variant`` (a model's ``lora`` section: ``cfg.model.lora`` or
``Trainer(..., lora=)``); the plan gives its LoRA rows on it (``plan.lora``) and the engine its trainer
here. Full training is ``trainer.Trainer`` over ``engine/step.StreamedTrainer``; the LoRA variant trains
adapters over a frozen, streamed base: ``lora_run.LoraTrainer`` for a config run, ``lora_stream.
LoraStreamTrainer`` over a user's model. ``trainer.Trainer`` asks here rather than testing ``model.lora``
itself; each function takes the full-training way as an argument (this module sits below ``trainer.py``).
"""
from __future__ import annotations

from typing import Any, Callable

from megatrain_jax.config import Config
from megatrain_jax.plan.lora import LORA, variant


def new_run(cfg: Config, plan: Any, full: Callable[[Config, Any], Any]) -> Any:
    """A new run of ``cfg`` (``Trainer.from_config``): the LoRA trainer for a model with adapters, else
    ``full(cfg, plan)``."""
    if variant(cfg.model.lora) == LORA:
        from megatrain_jax.engine.lora_run import LoraTrainer

        return LoraTrainer.from_config(cfg, plan)
    return full(cfg, plan)


def resumed_run(cfg: Config, root: str, plan: Any, log: Callable[[str], None],
                full: Callable[..., tuple[Any, str, dict]]) -> tuple[Any, str, dict]:
    """``cfg``'s run continued from the newest usable checkpoint in ``root`` (``Trainer.resume``): the LoRA
    trainer for a model with adapters, else ``full(cfg, root, plan, log)``; (trainer, checkpoint, state)."""
    if variant(cfg.model.lora) == LORA:
        from megatrain_jax.engine.lora_run import LoraTrainer

        return LoraTrainer.resume(cfg, root, plan, log)
    return full(cfg, root, plan, log)


def library_trainer(cls: type, lora: Any, args: tuple, kwargs: dict) -> Any:
    """``Trainer(model, ..., lora=)``'s object (``Trainer.__new__``): with adapters, a ``LoraStreamTrainer``
    over the user's model; without, a new ``cls`` (Python then runs its ``__init__``)."""
    if variant(lora) == LORA:
        from megatrain_jax.engine.lora_stream import LoraStreamTrainer

        return LoraStreamTrainer(*args, lora=lora, **kwargs)
    return object.__new__(cls)
